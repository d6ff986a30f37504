"""The planner reproduces the seed's figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedllm.core.kv_spec import KVSpec
from pagedllm.tools.planner import (
    _token_bytes,
    format_plan,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    load_shape,
    plan,
    shape_from_hf_config,
)


def test_seed_7b_one_gb_per_2048_token_sequence():
    shape = load_shape(preset="seed-7b")
    assert kv_bytes_per_token(shape, "float16") == 2 * 32 * 4096 * 2
    p = plan(shape, "80GB", "float16", max_model_len=2048)
    assert p.kv_bytes_per_seq_max_len == 2 * 32 * 4096 * 2048 * 2  # ~1 GB (1.07e9 bytes = 1 GiB)
    assert p.kv_bytes_per_seq_max_len == 2**30


def test_seed_13b_case_study():
    shape = load_shape(preset="seed-13b")
    p = plan(shape, "80GB", "float16", weights_memory="26GB", activation_memory="8GB",
             mean_prompt=300, mean_output=500, concurrency=8)
    assert p.kv_bytes_static_at_concurrency == 8 * 4096 * 2 * 40 * 5120 * 2  # ~26 GB
    assert round(p.kv_bytes_static_at_concurrency / 1e9) == 27 and p.kv_bytes_static_at_concurrency / 2**30 == 25
    assert p.kv_budget_bytes == 46 * 10**9
    assert p.max_seqs_static == 13  # 46 GB / 3.36 GB
    # ~800 real tokens: 50 blocks of 16 = 0.655 GB each -> 70 sequences instead of 13
    assert p.kv_bytes_per_seq_paged == 800 * 819200 and p.max_seqs_paged == 70
    assert p.static_utilization == pytest.approx(800 / 4096)


def test_gqa_and_fp8_arithmetic():
    shape = load_shape(preset="smollm2-135m")
    assert kv_bytes_per_token(shape, "float32") == 2 * 30 * 3 * 64 * 4  # kv heads, not hidden
    assert kv_bytes_per_token(shape, "bfloat16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(shape, "fp8_e4m3") == 2 * 30 * 3 * (64 + 2)  # + bf16 scale per head
    # two 32-value blocks a head: an fp16 scale + 32 int8 (q8_0) or 16 bytes of nibbles (q4_0)
    assert kv_bytes_per_token(shape, "q8_0") == 2 * 30 * 3 * 2 * 34
    assert kv_bytes_per_token(shape, "q8_0/q4_0") == 30 * 3 * 2 * (34 + 18)
    with pytest.raises(ValueError, match="K/V integer formats"):
        plan(shape, "8GB", "bfloat16/q4_0")


def test_plan_cli_json_and_model_sources(tiny_models):
    r = subprocess.run([sys.executable, "-m", "pagedllm", "plan", "--preset", "seed-7b", "--memory", "80GB",
                        "--max-model-len", "2048", "--json"], capture_output=True, text=True, check=True)
    d = json.loads(r.stdout)
    assert {"kv_bytes_per_token", "kv_bytes_per_seq_max_len", "max_seqs_static", "max_seqs_paged"} <= d.keys()
    assert d["kv_bytes_per_seq_max_len"] == 2**30
    folder = tiny_models["qwen2"][0]
    assert load_shape(folder).num_kv_heads == 2
    assert load_shape(folder + "/config.json").num_layers == 2
    from pagedllm.model_executor.model_loader import default_model_path

    g = load_shape(str(default_model_path()))
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.vocab_size) == (30, 3, 64, 49152)


def test_weights_per_format_and_a_gguf_as_stored(tmp_path):
    """The seed's question for a quantized model: 13B in Q4_0 leaves 18 GB more for KV than in fp16."""
    shape = load_shape(preset="seed-13b")
    fp16 = plan(shape, "80GB", "float16", weight_format="f16")
    q4 = plan(shape, "80GB", "float16", weight_format="q4_0")
    assert fp16.weights_bytes == shape.num_params * 2 and q4.weights_bytes == int(shape.num_params * 18 / 32)
    assert q4.max_seqs_paged > fp16.max_seqs_paged
    with pytest.raises(ValueError, match="weight format"):
        plan(shape, "80GB", weight_format="q3_k")
    pytest.importorskip("gguf")
    from pagedllm.bench.random_gguf import SHAPES, write_random_gguf

    path = write_random_gguf(tmp_path / "t.gguf", SHAPES["tiny"], "Q4_0", types={"attn_v.weight": "Q8_0"})
    from gguf import GGUFReader

    stored = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    assert load_shape(str(path)).weights_bytes == stored
    assert plan(load_shape(str(path)), "1GB").weights_bytes == stored


def test_a_mixture_of_experts_counts_every_expert(tiny_models):
    """Qwen3-MoE's HF config: the weights are every expert's (all stay in memory), the KV its attention's."""
    import json
    from pathlib import Path

    from pagedllm.tools.planner import load_shape

    folder, hf = tiny_models["qwen3-moe"]
    shape = load_shape(folder)
    c = json.loads((Path(folder) / "config.json").read_text())
    assert shape.num_experts == 8 and shape.head_dim == 16
    # the tiny model keeps a dense MLP in layer 1; the planner counts every layer as a MoE layer
    dense, moe = 3 * 64 * c["intermediate_size"], 8 * 3 * 64 * c["moe_intermediate_size"] + 64 * 8
    hf_params = sum(p.numel() for p in hf.parameters())
    qk_norms = 2 * 2 * 16  # per-head q/k norm weights, which the planner's count leaves out
    assert shape.num_params == hf_params - dense + moe - qk_norms


GEMMA3_4B = {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 10240, "vocab_size": 262208,
             "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072}


def test_sliding_window_layers_hold_their_window_as_the_engine_lays_them_out():
    shape = shape_from_hf_config(GEMMA3_4B, "gemma-3-4b")
    assert shape.layer_windows == tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))
    # 16,640 tokens in blocks of 16: the full group (5 layers) 1,040 blocks; 6 groups of 5 sliding layers hold
    # the blocks from token 16,640 - 1,023 on: 64 each; pages of 5 layers x 4 KV heads x 256 x 2 x bf16
    assert kv_bytes_per_sequence(shape, "bfloat16", 16640, 16) == (1040 + 6 * 64) * 16 * 5 * 4096
    assert kv_bytes_per_sequence(shape, "bfloat16", 16640, 16, hybrid=False) == 1040 * 16 * 34 * 4096
    p = plan(shape, "24GB", "bfloat16", mean_prompt=16384, mean_output=256, weight_format="q4_0")
    assert p.kv_bytes_per_seq_paged == (1040 + 6 * 64) * 16 * 5 * 4096 and p.layers == "29 window 1024, 5 full"
    assert "sliding-window layers keep their window" in format_plan(p)
    # Qwen2 carries a window it does not use; gpt-oss names each layer's kind
    assert shape_from_hf_config({**GEMMA3_4B, "model_type": "qwen2", "use_sliding_window": False}, "q").layer_windows == ()
    gpt = {**GEMMA3_4B, "model_type": "gpt_oss", "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 17}
    assert shape_from_hf_config(gpt, "g").layer_windows == (128, None) * 17


def test_linear_attention_layers_count_their_state_not_kv():
    """Qwen3.5's shape: 32 layers, 8 of them full attention; the other 24 keep a conv state and a recurrent state."""
    cfg = {"model_type": "qwen3_5_text", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 16,
           "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 12288, "vocab_size": 248320,
           "max_position_embeddings": 32768, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    shape = shape_from_hf_config(cfg, "qwen3.5")
    state = 24 * 4 * ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128)
    assert (shape.state_layers, shape.state_bytes_per_seq) == (24, state)
    assert kv_bytes_per_token(shape, "bfloat16") == 2 * 8 * 4 * 256 * 2
    assert kv_bytes_per_sequence(shape, "bfloat16", 1000, 16) == 63 * 16 * 8 * 4096 + state
    assert plan(shape, "80GB", "bfloat16").layers == "8 full, 24 linear attention"


def test_gemma4_layers_of_their_own_shapes_and_shared_kv():
    """Gemma 4: global layers of their own head size and KV heads; the last layers read earlier layers' K/V and
    keep none. Layers of two shapes share the pool in pages of the larger's bytes, as the engine lays them out."""
    cfg = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
           "attention_k_eq_v": True, "num_kv_shared_layers": 2, "sliding_window": 24, "intermediate_size": 128,
           "vocab_size": 320, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}
    shape = shape_from_hf_config(cfg, "gemma4")
    assert shape.layer_kv == ((2, 16), (2, 16), (1, 32), (2, 16)) and shape.shared_kv_layers == 2
    assert shape.layer_windows == (24, 24, None, 24)
    per_token = 3 * 2 * 16 * 2 * 2 + 1 * 32 * 2 * 2  # three sliding layers and one global, bf16 K and V
    assert kv_bytes_per_token(shape, "bfloat16") == per_token
    assert kv_bytes_per_sequence(shape, "bfloat16", 100, 16, hybrid=False) == 7 * 16 * per_token
    # a 32-value page per slot (one global layer, or one sliding layer: the same bytes): the full group's 7 blocks,
    # and each of 3 sliding groups the blocks from token 100 - 23 on (3 of 7)
    assert kv_bytes_per_sequence(shape, "bfloat16", 100, 16) == (7 + 3 * 3) * 16 * 32 * 2 * 2
    assert plan(shape, "1GB", "bfloat16").layers == "3 window 24, 1 full, 2 reading an earlier layer's KV"


GEMMA4_31B = {"model_type": "gemma4_text", "hidden_size": 5376, "num_hidden_layers": 60, "num_attention_heads": 32,
              "num_key_value_heads": 16, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
              "attention_k_eq_v": True, "sliding_window": 1024, "intermediate_size": 21504, "vocab_size": 262144,
              "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10, "max_position_embeddings": 262144}


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_gemma4_sliding_layers_hold_their_window_in_pages_of_another_shape(kv_dtype):
    """Gemma-4-31B-shaped: 50 sliding layers (16 KV heads of 256) and 10 global (4 of 512, half the bytes). At 32k
    tokens a request holds within 1.2x of the window arithmetic (global layers x length + sliding x window)."""
    shape = shape_from_hf_config(GEMMA4_31B, "gemma-4-31b")
    n = 32768
    arithmetic = sum(_token_bytes([KVSpec(h, d)], kv_dtype) * (n if w is None else w)
                     for (h, d), w in zip(shape.layer_kv, shape.layer_windows))
    paged = kv_bytes_per_sequence(shape, kv_dtype, n, 16)
    assert arithmetic <= paged <= 1.2 * arithmetic
    assert kv_bytes_per_sequence(shape, kv_dtype, n, 16, hybrid=False) > 4 * paged
