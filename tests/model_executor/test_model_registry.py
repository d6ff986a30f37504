"""An architecture is a model file and a registry line: a variant of our own, with weight names no
loader has heard of, loads from an HF folder and from a GGUF through the generic loaders and generates
what HF transformers generates from the same weights."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import make_tiny_model
from helpers import (
    gemma4_gguf_keys,
    hf_greedy,
    phi3_gguf_keys,
    qwen35_converter_values,
    qwen35_gguf_keys,
    renamed_weights,
    write_gguf_from_folder,
    write_gguf_from_hf,
)

from pagedllm import LLM, ConfigError, SamplingParams
from pagedllm.errors import ModelLoadError
from pagedllm.model_executor.model_loader import load_model
from pagedllm.model_executor.models import default_registry
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.weight_names import Linear, Param, Part, WeightNames


class RenamedLlama(LlamaForCausalLM):
    """The model file of the architecture: the Llama layers under other names, in both formats."""

    WEIGHTS = WeightNames(
        embed=Param("embed_tokens", "transformer.wte", "tok_embeddings"),
        norm=Param("norm", "transformer.ln_f", "norm_out"),
        lm_head=Linear("lm_head", (Part("head", "head"),)),
        linears=(
            Linear("qkv_proj", (Part("attn.wq", "wq"), Part("attn.wk", "wk"), Part("attn.wv", "wv"))),
            Linear("o_proj", (Part("attn.wo", "wo"),), "row"),
            Linear("gate_up_proj", (Part("ffn.w1", "w1"), Part("ffn.w3", "w3"))),
            Linear("down_proj", (Part("ffn.w2", "w2"),), "row"),
        ),
        norms=(Param("input_layernorm", "ln_attn", "ln1"), Param("post_attention_layernorm", "ln_ffn", "ln2")),
        hf_layer="transformer.h.{}.",
        gguf_layer="layers.{}.",
    )


def registry():
    return default_registry().register("RenamedLlamaForCausalLM", RenamedLlama, gguf="renamed")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("std"))


@pytest.fixture(scope="module")
def renamed_folder(hf_model, tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("renamed")
    cfg = hf_model.config.to_dict() | {"architectures": ["RenamedLlamaForCausalLM"]}
    (path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    save_file(renamed_weights(sd, RenamedLlama.WEIGHTS, "hf", hf_model.config.num_hidden_layers),
              str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def renamed_gguf(hf_model, tmp_path_factory):
    """F32 tensors in HF's row order (this architecture declares no interleaved rope), token-id prompts."""
    path = tmp_path_factory.mktemp("gguf") / "renamed.gguf"
    write_gguf_from_hf(hf_model, path, "renamed", RenamedLlama.WEIGHTS)
    return path


def test_unregistered_architecture_is_refused_by_name(renamed_folder) -> None:
    with pytest.raises(ModelLoadError, match="unsupported architecture 'RenamedLlamaForCausalLM'"):
        load_model(renamed_folder, dtype="float32")


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_registered_architecture_loads_through_the_generic_loaders(hf_model, renamed_folder, renamed_gguf,
                                                                   source: str) -> None:
    path = renamed_folder if source == "hf" else renamed_gguf
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, model_registry=registry())
    assert type(llm.engine.runner.model) is RenamedLlama
    prompts = [[(7 * i + 3 * j) % hf_model.config.vocab_size for j in range(5 + 4 * i)] for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 16)


def test_an_architecture_that_cannot_shard_says_so_before_any_worker_starts(renamed_folder) -> None:
    class SingleRank(RenamedLlama):
        supports_tensor_parallel = False

    mine = default_registry().register("RenamedLlamaForCausalLM", SingleRank)
    with pytest.raises(ModelLoadError, match="RenamedLlamaForCausalLM does not run under tensor parallelism"):
        LLM(model=str(renamed_folder), dtype="float32", tensor_parallel_size=2, model_registry=mine)


def test_a_registry_is_the_callers_not_global() -> None:
    mine = registry()
    assert "RenamedLlamaForCausalLM" in mine.architectures
    assert "RenamedLlamaForCausalLM" not in default_registry().architectures
    assert mine.model_class("Qwen2ForCausalLM").__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gemma9' is not supported"):
        mine.from_gguf("gemma9")


def test_qwen3_from_a_gguf_of_its_own_names_generates_what_hf_does(tiny_models, tmp_path) -> None:
    """The built-in Qwen3 (q/k norms: attn_q_norm, attn_k_norm) read from a `qwen3` GGUF by the generic loader."""
    from pagedllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    _, hf = tiny_models["qwen3"]
    path = tmp_path / "qwen3.gguf"
    write_gguf_from_hf(hf, path, "qwen3", Qwen3ForCausalLM.WEIGHTS)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    assert type(llm.engine.runner.model) is Qwen3ForCausalLM
    prompts = [[(5 * i + 7 * j) % hf.config.vocab_size for j in range(4 + 6 * i)] for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)


def test_llama3_rope_from_a_gguf_reads_its_per_pair_divisors(tiny_models, tmp_path) -> None:
    """Llama 3.1+ files carry their rope scaling only as `rope_freqs` (a divisor per rotary pair): read back as HF's
    llama3 parameters, they give HF's tokens over a prompt past the original context (ignored, they would not)."""
    import math

    from pagedllm.model_executor.layers.rotary import llama3_scaling_from_factors

    folder, hf = tiny_models["llama3-rope"]
    path = tmp_path / "llama3.gguf"
    write_gguf_from_folder(folder, path, "llama", LlamaForCausalLM.WEIGHTS)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.model.cfg.rope_scaling["rope_type"] == "llama3"
    prompt = [(5 * j + 3) % hf.config.vocab_size for j in range(100)]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 16)
    # Llama-3.1-8B's divisors as the converter computes them give back its parameters
    factors = []
    for i in range(64):
        wavelen = 2 * math.pi * 500000.0 ** (2 * i / 128)
        smooth = min(max((8192 / wavelen - 1.0) / (4.0 - 1.0), 0.0), 1.0)
        factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    got = llama3_scaling_from_factors(factors, 128, 500000.0)
    assert got["factor"] == 8.0 and got["original_max_position_embeddings"] == 8192
    assert abs(got["low_freq_factor"] - 1.0) < 1e-9 and abs(got["high_freq_factor"] - 4.0) < 1e-9
    assert llama3_scaling_from_factors([1.0] * 64, 128, 500000.0) is None
    with pytest.raises(ModelLoadError, match="not llama3"):
        llama3_scaling_from_factors([1.0, 3.0, 1.5, 8.0], 8, 10000.0)


def test_phi3_stacked_tensors_from_a_gguf_generate_what_hf_does(tiny_models, tmp_path) -> None:
    """Phi-3's fused attn_qkv and ffn_up (gate then up) read as stacked pieces by the generic GGUF loader."""
    from pagedllm.model_executor.models.phi3 import Phi3ForCausalLM

    _, hf = tiny_models["phi3"]
    path = tmp_path / "phi3.gguf"
    write_gguf_from_hf(hf, path, "phi3", Phi3ForCausalLM.WEIGHTS)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, max_model_len=1024)
    prompts = [[(3 * i + 11 * j) % hf.config.vocab_size for j in range(6 + 5 * i)] for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)


def test_longrope_caps_the_context_at_its_original_length_unless_asked_for_more(tiny_models) -> None:
    """Phi-4-mini's LongRoPE: by default the short factors and the original context (512 here); a longer
    max_model_len takes the long factors for every position, which is what HF computes for a sequence past the
    original length: greedy tokens equal HF's on a 600-token prompt."""
    path, hf = tiny_models["phi4-mini"]
    llm = LLM(model=path, dtype="float32", num_kv_blocks=64)
    assert llm.engine.runner.model.cfg.max_position_embeddings == 512
    long = LLM(model=path, dtype="float32", max_model_len=1024, kv_cache_memory="64MiB", max_num_batched_tokens=256)
    assert long.engine.max_model_len == 1024 and long.engine.runner.model.cfg.rope_scaling["long"]
    prompt = [(7 * j + 3) % hf.config.vocab_size for j in range(600)]
    out = long.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8)
    with pytest.raises(ConfigError, match="exceeds the model's context"):  # past the advertised 4,096 tokens
        LLM(model=path, dtype="float32", max_model_len=8192)


def test_longrope_from_a_gguf_reads_its_rope_factor_tensors(tiny_models, tmp_path) -> None:
    """A Phi-4-mini GGUF as llama.cpp's converter writes it: the rotary dims, the original context and the attention
    factor as metadata, the long and short factors as tensors. Short factors by default, long ones past the
    original context, each giving HF's greedy tokens."""
    from pagedllm.model_executor.models.phi3 import Phi3ForCausalLM

    _, hf = tiny_models["phi4-mini"]
    c = hf.config

    path = tmp_path / "phi4-mini.gguf"
    write_gguf_from_hf(hf, path, "phi3", Phi3ForCausalLM.WEIGHTS, extra=lambda w: phi3_gguf_keys(w, c.to_dict()))
    short = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    assert short.engine.runner.model.cfg.max_position_embeddings == 512
    prompt = [(5 * j + 2) % c.vocab_size for j in range(40)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert short.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8)
    long = LLM(model=str(path), dtype="float32", max_model_len=1024, kv_cache_memory="64MiB", max_num_batched_tokens=256)
    prompt = [(7 * j + 3) % c.vocab_size for j in range(600)]
    assert long.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8)


def test_a_quantized_phi4_mini_gguf_runs_its_partial_rotary_heads_in_their_blocks(tiny_models, tmp_path) -> None:
    """Phi-4-mini rotates 3/4 of each head: its q/k rows are read from attn_qkv in the order the kernels rotate
    (whole rows of blocks, so Q8_0 stays in its blocks): F32 gives HF's tokens, Q8_0 tracks the file dequantized."""
    from pagedllm.model_executor.layers.weight_formats import GGMLWeight
    from pagedllm.model_executor.models.phi3 import Phi3ForCausalLM
    from pagedllm.tools.evaluate import compare_to_reference

    folder, hf = tiny_models["phi4-mini"]

    f32, q8 = tmp_path / "f32.gguf", tmp_path / "q8.gguf"
    write_gguf_from_folder(folder, f32, "phi3", Phi3ForCausalLM.WEIGHTS, meta=phi3_gguf_keys)
    write_gguf_from_folder(folder, q8, "phi3", Phi3ForCausalLM.WEIGHTS, quant="q8_0", meta=phi3_gguf_keys)
    prompt = [(5 * j + 2) % hf.config.vocab_size for j in range(40)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = LLM(model=str(f32), dtype="float32", num_kv_blocks=64).generate([{"prompt_token_ids": prompt}], sp)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 8)
    native = LLM(model=str(q8), dtype="float32", num_kv_blocks=64)
    assert isinstance(native.engine.runner.model.layers[0].qkv_proj.packed, GGMLWeight)
    ref = LLM(model=str(q8), dtype="float32", num_kv_blocks=64, quantization="none")
    ids = [(i * 37 + i * i * 11) % hf.config.vocab_size for i in range(200)]
    r = compare_to_reference(ref.engine, native.engine, ids, chunk=50)
    assert r["mean_kl"] < 1e-3 and r["top1_agreement"] > 0.93, r


@pytest.mark.parametrize("arch,gguf_arch", [("qwen3-moe", "qwen3moe"), ("mixtral", "llama"), ("olmoe", "olmoe")])
def test_moe_from_a_gguf_with_3d_expert_tensors_generates_what_hf_does(tiny_models, tmp_path, arch, gguf_arch) -> None:
    """Experts stored as GGUF 3-D tensors (`ffn_gate_exps` ...): F32 gives HF's greedy tokens; Q8_0 experts run
    in their blocks (one slice a GGMLWeight) and stay within the format's tolerance of HF's logits."""
    folder, hf = tiny_models[arch]
    llm = LLM(model=folder, dtype="float32")
    names = type(llm.engine.runner.model).WEIGHTS
    path = tmp_path / "f32.gguf"
    write_gguf_from_folder(folder, path, gguf_arch, names)
    f32 = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    assert type(f32.engine.runner.model) is type(llm.engine.runner.model)
    prompts = [[(5 * i + 7 * j) % hf.config.vocab_size for j in range(4 + 6 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for p, o in zip(prompts, f32.generate([{"prompt_token_ids": p} for p in prompts], params)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
    q8 = tmp_path / "q8.gguf"
    write_gguf_from_folder(folder, q8, gguf_arch, names, quant="q8_0")
    model = LLM(model=str(q8), dtype="float32", num_kv_blocks=64).engine.runner.model
    assert model.weight_format == "q8_0+f32"  # the experts in their blocks; the routers in fp32 panels
    import torch

    prompt = prompts[2]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    out = LLM(model=str(q8), dtype="float32", num_kv_blocks=64).generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, logprobs=5, temperature=0))[0]
    top = max(out.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].logprob)[0]
    assert top == int(ref.argmax())


def test_gemma3_from_a_gguf_as_llama_cpp_stores_it_generates_what_hf_does(tiny_models, tmp_path) -> None:
    """`gemma3`: norms stored as 1 + w, the global layers' rope base and linear scaling in the metadata, the local
    base, the one-in-six pattern and the attention scale as llama.cpp fixes them in code."""
    from pagedllm.model_executor.models.gemma3 import Gemma3ForCausalLM

    folder, hf = tiny_models["gemma3-gguf"]
    path = tmp_path / "gemma3.gguf"
    write_gguf_from_folder(folder, path, "gemma3", Gemma3ForCausalLM.WEIGHTS, norm_shift=1.0)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    assert type(model) is Gemma3ForCausalLM
    assert [lay.sliding_window for lay in model.layers] == [24] * 5 + [None, 24]
    from pagedllm.tools.planner import load_shape

    assert load_shape(str(path)).layer_windows == (24,) * 5 + (None, 24)  # the planner reads the same pattern
    prompts = [[(5 * i + 7 * j) % hf.config.vocab_size for j in range(4 + 20 * i)] for i in range(3)]  # past the window
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)


def test_the_text_tower_of_a_gemma3_multimodal_checkpoint_generates_what_hf_does(tmp_path) -> None:
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration: the language model's tensors under
    `language_model.model.`, its config under `text_config`; text in, text out."""
    import torch
    import transformers

    from pagedllm.tools.planner import load_shape

    tc = transformers.Gemma3TextConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                                       query_pre_attn_scalar=16, initializer_range=0.15)
    vc = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=tc, vision_config=vc, mm_tokens_per_image=4)).eval()
    _text_tower_generates_what_hf_does(hf, tmp_path, "Gemma3TextTower", prompt_step=20)
    assert load_shape(str(tmp_path)).num_layers == 3


def test_the_text_tower_of_a_qwen3_5_multimodal_checkpoint_generates_what_hf_does(tmp_path) -> None:
    """The released Qwen3.5 models are Qwen3_5ForConditionalGeneration: the language model's tensors under
    `model.language_model.`, its config under `text_config`; text in, text out."""
    import torch
    import transformers

    tc = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, initializer_range=0.15,
              layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [1, 1, 0]})
    vc = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=tc, vision_config=vc)).eval()
    _text_tower_generates_what_hf_does(hf, tmp_path, "Qwen3_5TextTower", prompt_step=30)


def test_the_text_tower_of_a_gemma4_multimodal_checkpoint_generates_what_hf_does(tmp_path) -> None:
    """The released Gemma 4 models are Gemma4ForConditionalGeneration: the language model's tensors (its per-layer
    input tables too) under `model.language_model.`, its config under `text_config`; text in, text out."""
    import torch
    import transformers

    tc = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, num_kv_shared_layers=1, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=320, sliding_window=24, initializer_range=0.15,
              layer_types=["sliding_attention", "full_attention"] * 2)
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16)
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=tc, vision_config=vc, audio_config=None)).eval()
    _text_tower_generates_what_hf_does(hf, tmp_path, "Gemma4TextTower", prompt_step=20)


def test_gemma4_configs_as_released_and_what_they_give() -> None:
    """The released configs give the global layers' shape as global_head_dim / num_global_key_value_heads (HF
    turns them into per_layer_config); the KV-shared layers keep no KV; the experts' fields; bidirectional
    attention is refused by name."""
    from pagedllm.errors import ModelLoadError
    from pagedllm.model_executor.models.gemma4 import Gemma4ForCausalLM

    raw = dict(architectures=["Gemma4ForCausalLM"], vocab_size=320, hidden_size=64, intermediate_size=128,
               num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=64,
               num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2, sliding_window=24,
               layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1e6}})
    cfg = Gemma4ForCausalLM.config_from_hf(raw)
    assert cfg.layer_shapes == ((16, 2), (16, 2), (64, 1)) * 2
    assert cfg.kv_sources == (0, 1, 2, 3, 3, 2)  # the last sliding / global layer before the shared ones
    model = Gemma4ForCausalLM(cfg)
    assert [s is None for s in model.kv_specs()] == [False] * 4 + [True] * 2
    inv = model.rope_inv_freq("full_attention")  # 64-dim heads: 8 of 32 pairs rotate, the rest stay put
    assert inv.shape == (32,) and (inv[:8] > 0).all() and (inv[8:] == 0).all()
    moe = Gemma4ForCausalLM.config_from_hf({**raw, "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
                                            "moe_intermediate_size": 32})
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 32)
    with pytest.raises(ModelLoadError, match="bidirectional"):
        Gemma4ForCausalLM.config_from_hf({**raw, "use_bidirectional_attention": "all"})


def _text_tower_generates_what_hf_does(hf, path, tower: str, prompt_step: int) -> None:
    """A multimodal HF model (norms moved off their init) saved to path: pagedllm loads its language model as
    `tower` and generates HF's greedy tokens for three prompts of 4, 4 + step and 4 + 2 step tokens."""
    import torch

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    assert type(llm.engine.runner.model).__name__ == tower
    prompts = [[(5 * i + 7 * j) % 300 + 1 for j in range(4 + prompt_step * i)] for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)


def test_gpt_oss_from_a_gguf_generates_what_hf_does_and_runs_mxfp4_experts_as_stored(tiny_models, tmp_path) -> None:
    """`gpt-oss`: attention biases and sinks, the router's and experts' biases, the sliding-window pattern and the
    SwiGLU constants as llama.cpp fixes them, YaRN from the metadata. F32 gives HF's greedy tokens; experts in
    MXFP4 (as OpenAI released them) run in their blocks and track the same file dequantized."""
    from pagedllm.model_executor.models.gpt_oss import GptOssForCausalLM
    from pagedllm.tools.evaluate import compare_to_reference

    folder, hf = tiny_models["gpt-oss-gguf"]
    path = tmp_path / "gpt-oss.gguf"
    write_gguf_from_folder(folder, path, "gpt-oss", GptOssForCausalLM.WEIGHTS)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    assert type(model) is GptOssForCausalLM and [lay.sliding_window for lay in model.layers] == [24, None, 24]
    prompts = [[(5 * i + 7 * j) % hf.config.vocab_size for j in range(4 + 20 * i)] for i in range(3)]  # past the window
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for p, o in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
    mx = tmp_path / "mxfp4.gguf"
    write_gguf_from_folder(folder, mx, "gpt-oss", GptOssForCausalLM.WEIGHTS, expert_quant="mxfp4")
    native = LLM(model=str(mx), dtype="float32", num_kv_blocks=64)
    assert native.engine.runner.model.weight_format == "f32+mxfp4"  # no dequantized copy of the experts
    ref = LLM(model=str(mx), dtype="float32", num_kv_blocks=64, quantization="none")
    ids = [(i * 37 + i * i * 11) % hf.config.vocab_size for i in range(200)]
    r = compare_to_reference(ref.engine, native.engine, ids, chunk=50)
    assert r["mean_kl"] < 0.015 and r["top1_agreement"] > 0.93, r  # int8 activations (and the routing they flip)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma4", "gemma4-moe"])
def test_gemma4_from_a_gguf_as_llama_cpp_stores_it_generates_what_hf_does(tiny_models, tmp_path, arch) -> None:
    """`gemma4`: sliding and global layers of their own head sizes and KV heads, v = k where a global layer has no
    `attn_v`, the KV-shared layers' q alone and their twice-wide MLPs, per-layer inputs, the router's scales under
    llama.cpp's `.scale` names, the experts' gate and up in one 3-D tensor: HF's greedy tokens past the window, and
    the planner reads the same KV layout from the file."""
    from pagedllm.model_executor.models.gemma4 import Gemma4ForCausalLM
    from pagedllm.tools.planner import load_shape

    folder, hf = tiny_models[arch]
    path = tmp_path / "gemma4.gguf"
    write_gguf_from_folder(folder, path, "gemma4", Gemma4ForCausalLM.WEIGHTS, meta=gemma4_gguf_keys)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    ref = LLM(model=folder, dtype="float32", num_kv_blocks=64).engine.runner.model
    model = llm.engine.runner.model
    assert type(model) is Gemma4ForCausalLM
    assert model.kv_specs() == ref.kv_specs()
    # the same config but for what a file without a vocabulary lacks and the top-level rope base no layer reads
    unread = {"rope_theta": ref.cfg.rope_theta, "bos_token_id": ref.cfg.bos_token_id, "eos_token_id": ref.cfg.eos_token_id}
    assert dataclasses.replace(model.cfg, **unread) == ref.cfg
    assert load_shape(str(path)).kv_specs() == [s for s in ref.kv_specs() if s is not None]
    prompts = [[(5 * i + 7 * j) % hf.config.vocab_size for j in range(4 + 20 * i)] for i in range(3)]  # past the window
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)


@pytest.mark.slow
@pytest.mark.parametrize("arch,gguf_arch", [("qwen3.5", "qwen35"), ("qwen3.5-moe-gguf", "qwen35moe")])
def test_qwen35_from_a_gguf_as_llama_cpp_stores_it_generates_what_hf_does(tiny_models, tmp_path, arch,
                                                                           gguf_arch) -> None:
    """`qwen35` / `qwen35moe`: the Gated DeltaNet layers in llama.cpp's `ssm_*` tensors and keys, value heads in its
    tiled order (two key heads for four value heads in the MoE model: the order matters), the decay rates as
    -exp(A_log): HF's greedy tokens, and the planner reads the layers' kinds and state size from the file. The same
    file read with HF's value-head order is not HF's model (the order is read, not assumed)."""
    import torch

    from pagedllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM
    from pagedllm.tools.planner import load_shape

    folder, hf = tiny_models[arch]
    path = tmp_path / f"{gguf_arch}.gguf"
    write_gguf_from_folder(folder, path, gguf_arch, Qwen3_5ForCausalLM.WEIGHTS, meta=qwen35_gguf_keys,
                           transform=qwen35_converter_values)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    ref = LLM(model=folder, dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    assert type(model) is Qwen3_5ForCausalLM and model.kv_specs() == ref.engine.runner.model.kv_specs()
    assert model.state_bytes_per_seq() == ref.engine.runner.model.state_bytes_per_seq()
    shape = load_shape(str(path))
    assert (shape.state_layers, shape.state_bytes_per_seq) == (3, model.state_bytes_per_seq())
    prompts = [[(5 * i + 7 * j) % hf.config.vocab_size for j in range(4 + 20 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for p, o in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params)):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)
    if 1 < hf.config.linear_num_key_heads < hf.config.linear_num_value_heads:  # (one key head: both orders agree)
        for layer in model.layers:
            layer.tiled = False if hasattr(layer, "tiled") else None
        with torch.no_grad():
            logits = hf(torch.tensor([prompts[2]])).logits[0, -1]
        out = llm.generate({"prompt_token_ids": prompts[2]}, SamplingParams(max_tokens=1, logprobs=1, temperature=0))[0]
        got = out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].logprob
        assert abs(got - float(torch.log_softmax(logits, -1).max())) > 1e-3


def test_gpt_oss_mxfp4_experts_from_an_hf_folder_run_as_stored(tiny_models, tmp_path) -> None:
    """OpenAI's checkpoint layout: each layer's experts as MXFP4 `*_blocks` / `*_scales`. They load as ggml MXFP4
    blocks whose dequantization is HF's own (transformers' convert_moe_packed_tensors), bit for bit, and the model
    tracks the same weights stored dense."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagedllm.tools.evaluate import compare_to_reference

    folder, hf = tiny_models["gpt-oss"]
    sd = load_file(f"{folder}/model.safetensors")
    mx, dense = tmp_path / "mxfp4", tmp_path / "dense"
    g = torch.Generator().manual_seed(0)
    packed = dict(sd)
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, o = sd[name].shape  # HF's dense layout [E, in, out]
        blocks = torch.randint(0, 256, (e, o, k // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(121, 125, (e, o, k // 32), generator=g, dtype=torch.uint8)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        sd[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    cfg = json.loads(Path(folder, "config.json").read_text())
    for out, tensors, extra in ((mx, packed, {"quantization_config": {"quant_method": "mxfp4"}}), (dense, sd, {})):
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**cfg, **extra}))
    native = LLM(model=str(mx), dtype="float32", num_kv_blocks=64)
    model = native.engine.runner.model
    assert "mxfp4" in model.weight_format
    expert = model.layers[1].mlp.experts[2]
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"][2]  # [hidden, 2 I], gate and up interleaved
    assert torch.equal(expert.gate_up_proj.packed.dequantize(), torch.cat((gate_up[:, 0::2].T, gate_up[:, 1::2].T)))
    assert torch.equal(expert.down_proj.packed.dequantize(), sd["model.layers.1.mlp.experts.down_proj"][2].T)
    ref = LLM(model=str(dense), dtype="float32", num_kv_blocks=64)
    ids = [(i * 37 + i * i * 11) % hf.config.vocab_size for i in range(200)]
    r = compare_to_reference(ref.engine, native.engine, ids, chunk=50)
    assert r["mean_kl"] < 0.015 and r["top1_agreement"] > 0.93, r
