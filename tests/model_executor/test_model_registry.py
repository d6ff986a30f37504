"""An architecture is a model file and a registry line: a variant of our own, with weight names no
loader has heard of, loads from an HF folder and from a GGUF through the generic loaders and generates
what HF transformers generates from the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from helpers import hf_greedy

from pagedllm import LLM, SamplingParams
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


def _renamed(hf_sd: dict[str, torch.Tensor], fmt: str, layers: int) -> dict[str, torch.Tensor]:
    """HF Llama's tensors under RenamedLlama's names (fmt "hf" or "gguf")."""
    std, new = LlamaForCausalLM.WEIGHTS, RenamedLlama.WEIGHTS
    out = {}

    def put(a: str, b: str) -> None:
        for suffix in (".weight", ".bias"):
            if a + suffix in hf_sd:
                out[b + suffix] = hf_sd[a + suffix]

    put(std.embed.hf, getattr(new.embed, fmt))
    put(std.norm.hf, getattr(new.norm, fmt))
    put(std.lm_head.parts[0].hf, getattr(new.lm_head.parts[0], fmt))
    layer = new.hf_layer if fmt == "hf" else new.gguf_layer
    for i in range(layers):
        for s, n in zip(std.linears, new.linears):
            for ps, pn in zip(s.parts, n.parts):
                put(std.hf_layer.format(i) + ps.hf, layer.format(i) + getattr(pn, fmt))
        for s, n in zip(std.norms, new.norms):
            put(std.hf_layer.format(i) + s.hf, layer.format(i) + getattr(n, fmt))
    return out


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
    save_file(_renamed(sd, "hf", hf_model.config.num_hidden_layers), str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def renamed_gguf(hf_model, tmp_path_factory):
    """F32 tensors in HF's row order (this architecture declares no interleaved rope), token-id prompts."""
    from gguf import GGUFWriter

    c = hf_model.config
    path = tmp_path_factory.mktemp("gguf") / "renamed.gguf"
    w = GGUFWriter(str(path), "renamed")
    for key, v in (("block_count", c.num_hidden_layers), ("embedding_length", c.hidden_size),
                   ("feed_forward_length", c.intermediate_size), ("attention.head_count", c.num_attention_heads),
                   ("attention.head_count_kv", c.num_key_value_heads), ("context_length", c.max_position_embeddings),
                   ("vocab_size", c.vocab_size)):
        w.add_uint32(f"renamed.{key}", v)
    w.add_float32("renamed.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32("renamed.rope.freq_base", c.rope_theta if hasattr(c, "rope_theta") else 10000.0)
    sd = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    for name, t in _renamed(sd, "gguf", c.num_hidden_layers).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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


def test_a_registry_is_the_callers_not_global() -> None:
    mine = registry()
    assert "RenamedLlamaForCausalLM" in mine.architectures
    assert "RenamedLlamaForCausalLM" not in default_registry().architectures
    assert mine.model_class("Qwen2ForCausalLM").__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gemma9' is not supported"):
        mine.from_gguf("gemma9")
