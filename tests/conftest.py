"""Tiny random HF models (the oracle) saved as folders our engine loads."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run in its interpreter here, which is read as triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            initializer_range=0.15, rms_norm_eps=1e-6)

_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 256,
         "rope_theta": 150000.0}
_GPT_OSS = dict(head_dim=16, num_hidden_layers=3, sliding_window=24, num_local_experts=4, num_experts_per_tok=2,
                intermediate_size=32)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=48, head_dim=24)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=40, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # 7 layers: sliding (window 24, local rope base), one global in six (global base, linear rope scaling)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, num_hidden_layers=7, sliding_window=24, query_pre_attn_scalar=20, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    # the attention scale llama.cpp assumes for a GGUF (head_dim), no soft-capping, one global layer in six
    "gemma3-gguf": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, num_hidden_layers=7, sliding_window=24, query_pre_attn_scalar=16,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    # 8 layers: sliding and global layers of their own shapes (head 16 x 2 KV heads; 32 x 1, v = k's projection,
    # proportional rope on a quarter of the pairs); the last 3 share the K/V of layers 2 and 4 and have twice-wide
    # MLPs; per-layer inputs of 8 per layer
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=8,
        num_kv_shared_layers=3, hidden_size_per_layer_input=8, vocab_size_per_layer_input=320, sliding_window=24,
        use_double_wide_mlp=True, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2
        + ["sliding_attention", "full_attention"])),
    # the mixture-of-experts block beside each dense MLP (top 2 of 4 GeGLU experts), no per-layer inputs
    "gemma4-moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        head_dim=16, global_head_dim=32, num_hidden_layers=4, sliding_window=24, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32, hidden_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention"] * 2)),
    # Phi-4-mini's rope: half of each head rotated, LongRoPE (short factors within the original context)
    "phi4-mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=4096, partial_rotary_factor=0.5,
        original_max_position_embeddings=512, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [4.0, 5.0, 6.0, 7.0],
            "original_max_position_embeddings": 512})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # layer 1 keeps a dense MLP: both kinds of layer in one model
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, clip_qkv=2.5,
                                                      eos_token_id=2, pad_token_id=1)),
    # 3 layers: sliding (window 24), global, sliding; YaRN past 256 positions; attention sinks; clamped SwiGLU
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(_GPT_OSS, rope_parameters=dict(_YARN, truncate=False))),
    # YaRN's ramp ends rounded to whole pairs, as llama.cpp computes it for a GGUF
    "gpt-oss-gguf": ("GptOssConfig", "GptOssForCausalLM", dict(_GPT_OSS, rope_parameters=dict(_YARN, truncate=True))),
    # 4 layers: Gated DeltaNet, DeltaNet, full attention (output gate, rope on a quarter of each head), DeltaNet;
    # each key head serves two value heads
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    # the same layers, each MLP routed experts (top 2 of 4) and a gated shared expert
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
}
# Gemma 4's layers with two KV heads on the global layers too: a model tensor parallelism cuts in two
ARCHS["gemma4-tp"] = ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(ARCHS["gemma4"][2], num_global_key_value_heads=2))
# two key heads for four value heads: llama.cpp's converter reorders the value heads of such a model
ARCHS["qwen3.5-moe-gguf"] = ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                             dict(ARCHS["qwen3.5-moe"][2], linear_num_key_heads=2, linear_num_value_heads=4))


def make_tiny_model(arch: str, path, seed: int = 0):
    import transformers

    cfg_cls, model_cls, extra = ARCHS[arch]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    if arch.startswith(("gemma3", "gemma4", "qwen3.5")):  # norms off their init: (1 + w) or w is exercised
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                    p.add_(0.1 * torch.randn_like(p))
            for name, b in model.named_buffers():
                if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
                    b.add_(0.2 * torch.randn_like(b))
    if arch.startswith("gpt-oss"):  # biases and sinks away from their zero init, gates past the SwiGLU clamp (7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    p.copy_(torch.randn_like(p) * (1.0 if "sinks" in name else 0.3))
                elif name.endswith("gate_up_proj"):
                    p.mul_(6.0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (folder, HF model)."""
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (str(path), make_tiny_model(arch, path))
    return out


@pytest.fixture(scope="session")
def ops():
    """This CPU's kernels (the build every engine on it loads); skipped only where they are turned off."""
    from pagedllm.platforms.cpu import load_ops

    if os.environ.get("PAGEDLLM_NO_CPP"):
        pytest.skip("C++ kernels disabled")
    o = load_ops()
    assert o is not None, "the C++ ops build on this machine"
    return o


@pytest.fixture(scope="session")
def int8_decode() -> bool:
    """Whether this CPU's GGUF decode dots take int8 activations (AVX2: ggml's arithmetic; AVX-512 VNNI takes int16,
    the pure-torch paths none), so that greedy continuations can part from the higher-precision paths'."""
    from pagedllm.platforms.cpu import load_ops

    o = load_ops()
    return o is not None and o.linear_ggml_isa == "avx2"


@pytest.fixture(scope="session")
def ops_avx2():
    """Every kernel as a CPU without AVX-512 (Zen 3: AVX2, FMA) compiles it, built here by masking this CPU's
    AVX-512 and AVX-VNNI: the whole library that CPU loads, not a file of it. Built once per session (2-3
    minutes cold on two cores) and cached by source, flags and CPU like the real build."""
    from pagedllm.platforms.cpu import build_ops

    if os.environ.get("PAGEDLLM_NO_CPP"):
        pytest.skip("C++ kernels disabled")
    return build_ops(("-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile"))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_tiny_tokenizer(path, vocab_size: int = 320) -> None:
    """A byte-level BPE of exactly vocab_size tokens trained on the test text, ChatML template."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    from pagedllm.tools.evaluate import EVAL_TEXT

    text = EVAL_TEXT.read_text()
    tok.train_from_iterator([text], trainer)
    assert tok.get_vocab_size() == vocab_size
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML}))


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """A tiny random Llama with a real tokenizer and chat template."""
    path = tmp_path_factory.mktemp("llama-chat")
    make_tiny_model("llama", path, seed=5)
    add_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def llama_dir(tiny_models):
    return tiny_models["llama"][0]


@pytest.fixture(scope="session")
def smollm():
    from pagedllm import LLM

    return LLM(max_model_len=2048, kv_cache_memory="512MiB")


def full_layout_kv_memory(config, num_blocks: int, block_size: int, dtype_bytes: int = 4) -> int:
    """The bytes of num_blocks blocks that hold every layer (fp32 by default): a pool of the same memory for any
    layout (a hybrid layout's smaller pages make more blocks of it)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    shared = getattr(config, "kv_sharing_modes", None) or [None] * n  # Gemma 4: "reuse" keeps no KV of its own
    per_layer = getattr(config, "per_layer_config", None)  # Gemma 4: layers of their own shapes
    total = 0
    for i in range(n):
        if types[i] == "linear_attention" or shared[i] == "reuse":  # a state, or another layer's K/V
            continue
        c = per_layer[i] if per_layer is not None else config
        head_dim = getattr(c, "head_dim", None) or config.hidden_size // config.num_attention_heads
        total += 2 * c.num_key_value_heads * head_dim
    return num_blocks * block_size * total * dtype_bytes
