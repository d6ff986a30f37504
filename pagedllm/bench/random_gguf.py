"""Random-weight GGUF files of real model shapes, for sizes no package ships (`pagedllm bench
random-gguf`) and for the tests: real shapes, real kernels, noise outputs.

Weights are N(0, std) (default 0.02) quantized with gguf-py where it has a quantizer (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1); K-quants and other types get random blocks with fp16 scales of the same
spread, centred (every bit pattern of the quants is a valid block). With
`fast=True` every quantized type gets random blocks (a 7-8B file in seconds instead of minutes).
The tokenizer and chat template can be copied from another GGUF (the default model's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    context: int = 4096
    rope_theta: float = 10000.0
    # the GGUF architecture: llama, qwen3 (q/k norms), qwen3moe (q/k norms, experts), gemma3 (q/k norms, norms
    # after attention and MLP, 1024-token windows on five layers in six) or gpt-oss (experts, biases, attention
    # sinks, sliding-window layers, YaRN)
    arch: str = "llama"
    head_dim: int | None = None  # None: hidden / heads
    experts: int = 0  # per layer, in place of the dense MLP
    experts_used: int = 0
    expert_intermediate: int = 0


SHAPES = {
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 49152, 8192, 500000.0),  # SmolLM2's vocabulary
    # 128 experts of 768, 8 routed a token: ~30B weights, ~3B of them active (SmolLM2's vocabulary)
    "qwen3-30b-a3b": Shape(2048, 6144, 48, 32, 4, 49152, 4096, 1e6, "qwen3moe", 128, 128, 8, 768),
    "tiny": Shape(256, 512, 2, 4, 2, 320, 1024),
    "tiny-moe": Shape(256, 512, 2, 4, 2, 320, 1024, 1e6, "qwen3moe", 64, 8, 2, 256),
    "tiny-qwen3.5": Shape(256, 512, 4, 4, 2, 320, 1024, 1e7, "qwen35", 64),
    "tiny-gpt-oss": Shape(256, 512, 2, 4, 2, 320, 1024, 150000.0, "gpt-oss", 64, 8, 2, 256),
    # 32 experts of 2880, 4 routed a token: ~21B weights, ~3.6B active (SmolLM2's vocabulary, not its 201k one)
    "gpt-oss-20b": Shape(2880, 2880, 24, 64, 8, 49152, 4096, 150000.0, "gpt-oss", 64, 32, 4, 2880),
    # Gemma 3 4B's text model: head_dim 256 (SmolLM2's vocabulary, not Gemma's 262k)
    "gemma3-4b": Shape(2560, 10240, 34, 8, 4, 49152, 8192, 1e6, "gemma3", 256),
    # Qwen3.5 9B's text model: three Gated DeltaNet layers (16 key heads, 32 value heads of 128) for each gated
    # full-attention one (head_dim 256, rope on a quarter) (SmolLM2's vocabulary, not its 248k one)
    "qwen3.5-9b": Shape(4096, 12288, 32, 16, 4, 49152, 262144, 1e7, "qwen35", 256),
}
# Qwen3.5's Gated DeltaNet (qwen35 shapes): key heads, value heads, key / value head size, conv kernel, and every
# fourth layer full attention
_DELTA_NET = (16, 32, 128, 128, 4)
_QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def random_tensor(rng: np.random.Generator, rows: int, cols: int, qtype: str, fast: bool = False,
                  std: float = 0.02) -> np.ndarray:
    """[rows, cols] weights in qtype: a float array for F32/F16, else [rows, row_bytes] uint8 blocks."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    t = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std)
    if qtype == "F16":
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)
    if qtype in _QUANTIZABLE and not fast:
        return quantize(rng.standard_normal((rows, cols), dtype=np.float32) * std, t)
    qk, nbytes = GGML_QUANT_SIZES[t]
    if qtype == "MXFP4":  # random fp4 codes under one power-of-two scale: w = 2^(e - 128) * (codes' values, std 5.85)
        raw = rng.integers(0, 256, size=(rows * (cols // qk), nbytes), dtype=np.uint8)
        raw[:, 0] = 128 + round(np.log2(std / 5.85))
        return raw.reshape(rows, -1)
    if qtype not in _BLOCK_SCALES:
        raise ValueError(f"no random-block recipe for {qtype}")
    nb = rows * (cols // qk)
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    spread, d_at, m_at, offset = _BLOCK_SCALES[qtype]

    def fp16(v: np.ndarray) -> np.ndarray:
        return v.astype(np.float16).view(np.uint8).reshape(nb, 2)

    if qtype in ("Q4_K", "Q5_K"):  # every sub-block scale and min = v, so w = d v (q - offset): centred
        v = rng.integers(16, 64, size=nb, dtype=np.uint8)
        raw[:, 4:12] = ((v & 63) | ((v >> 4) << 6))[:, None]
        raw[:, 12:16] = ((v & 15) | ((v & 15) << 4))[:, None]
        d = std / (v * spread)
        raw[:, 0:2], raw[:, 2:4] = fp16(d), fp16(d * offset)
    elif qtype == "Q6_K":  # sixteen int8 scales of 16: w = d * 16 * (q - 32)
        raw[:, 192:208] = 16
        raw[:, 208:210] = fp16(np.full(nb, std / (16 * spread)))
    else:  # a leading fp16 scale, for Q4_1 / Q5_1 a min making the block centred
        d = np.full(nb, std / spread)
        raw[:, d_at:d_at + 2] = fp16(d)
        if m_at is not None:
            raw[:, m_at:m_at + 2] = fp16(-d * offset)
    return raw.reshape(rows, -1)


# llama.cpp's LLAMA_FTYPE of a file whose linears are all of one type (what llama-bench prints)
_FTYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K": 15, "Q5_K": 17,
          "Q6_K": 18, "BF16": 32}

# type -> (std of the quant values, byte of d, byte of the min or None, the quants' centre)
_BLOCK_SCALES = {
    "Q4_0": (4.6, 0, None, 0), "Q4_1": (4.6, 0, 2, 7.5), "Q5_0": (9.2, 0, None, 0), "Q5_1": (9.2, 0, 2, 15.5),
    "Q8_0": (74.0, 0, None, 0), "Q4_K": (4.6, 0, None, 7.5), "Q5_K": (9.2, 0, None, 15.5), "Q6_K": (18.5, 0, None, 0),
    "IQ4_NL": (70.0, 0, None, 0),
}


def write_random_gguf(path: Path, shape: Shape, qtype: str, seed: int = 0, types: dict[str, str] | None = None,
                      tokenizer_from: Path | None = None, fast: bool = False, tie: bool = True,
                      std: float = 0.02) -> Path:
    """A GGUF of shape.arch at path: every linear in qtype unless `types` maps a tensor-name suffix (e.g.
    "attn_v.weight") to another; norms and routers F32; token_embd in qtype (tied lm_head unless tie=False,
    then output.weight in qtype). Experts are 3-D tensors (`ffn_gate_exps` ...). Tensors are generated and
    written one at a time, so a file larger than RAM can be written."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, RopeScalingType

    from ..model_executor.model_loader.gguf_file import open_gguf

    rng = np.random.default_rng(seed)
    types = types or {}
    w = GGUFWriter(str(path), shape.arch)
    head_dim = shape.head_dim or shape.hidden // shape.heads
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(_FTYPE.get(qtype, 0))
    oss = shape.arch == "gpt-oss"
    if oss:  # gpt-oss-20b's: 128-token windows on every other layer, YaRN from a 4096 context to 32x
        w.add_sliding_window(128)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    if shape.arch == "gemma3":
        w.add_sliding_window(1024)
    delta = shape.arch == "qwen35"
    if delta:
        hk, hv, dk, dv, kernel = _DELTA_NET
        w.add_ssm_conv_kernel(kernel)
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(hk)
        w.add_ssm_time_step_rank(hv)
        w.add_ssm_inner_size(hv * dv)
        w.add_array(f"{shape.arch}.attention.recurrent_layers", [i % 4 != 3 for i in range(shape.layers)])
        w.add_full_attention_interval(4)
        w.add_rope_dimension_count(head_dim // 4)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_intermediate)
    if tokenizer_from is not None:
        src = open_gguf(tokenizer_from)
        for name, field in src.fields.items():
            if name.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
                w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)

    # (name, experts or 0, rows, cols, ggml type; None: an F32 norm (or bias) of `cols`, "router": F32 [rows, cols])
    tensors: list[tuple[str, int, int, int, str | None]] = []

    def add(name: str, rows: int, cols: int, experts: int = 0) -> None:
        tensors.append((name, experts, rows, cols, next((t for sfx, t in types.items() if name.endswith(sfx)), qtype)))

    def norm(name: str, n: int = shape.hidden, experts: int = 0) -> None:
        tensors.append((name, experts, 1, n, None))

    add("token_embd.weight", shape.vocab, shape.hidden)
    if not tie:
        add("output.weight", shape.vocab, shape.hidden)
    norm("output_norm.weight")
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    for i in range(shape.layers):
        p = f"blk.{i}."
        if delta and i % 4 != 3:  # a Gated DeltaNet layer (llama.cpp's ssm_* names; A stored as -exp(A_log))
            conv = 2 * hk * dk + hv * dv
            add(p + "attn_qkv.weight", conv, shape.hidden)
            add(p + "attn_gate.weight", hv * dv, shape.hidden)
            add(p + "ssm_beta.weight", hv, shape.hidden)
            add(p + "ssm_alpha.weight", hv, shape.hidden)
            add(p + "ssm_out.weight", shape.hidden, hv * dv)
            tensors.append((p + "ssm_conv1d.weight", 0, conv, kernel, "router"))
            tensors.append((p + "ssm_a", 0, 1, hv, "negative"))
            norm(p + "ssm_dt.bias", hv)
            norm(p + "ssm_norm.weight", dv)
            add(p + "ffn_gate.weight", shape.intermediate, shape.hidden)
            add(p + "ffn_up.weight", shape.intermediate, shape.hidden)
            add(p + "ffn_down.weight", shape.hidden, shape.intermediate)
            norm(p + "attn_norm.weight")
            norm(p + "post_attention_norm.weight")
            continue
        add(p + "attn_q.weight", 2 * q if delta else q, shape.hidden)  # Qwen3.5: each head's q, then its gate
        add(p + "attn_k.weight", kv, shape.hidden)
        add(p + "attn_v.weight", kv, shape.hidden)
        add(p + "attn_output.weight", shape.hidden, q)
        if shape.arch in ("qwen3", "qwen3moe", "gemma3", "qwen35"):
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
        if shape.arch == "gemma3":
            norm(p + "post_attention_norm.weight")
            norm(p + "post_ffw_norm.weight")
        if oss:
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", shape.hidden)):
                norm(f"{p}{name}.bias", n)
            norm(p + "attn_sinks.weight", shape.heads)
        if shape.experts:
            tensors.append((p + "ffn_gate_inp.weight", 0, shape.experts, shape.hidden, "router"))
            e, n = shape.experts, shape.expert_intermediate
            add(p + "ffn_gate_exps.weight", n, shape.hidden, e)
            add(p + "ffn_up_exps.weight", n, shape.hidden, e)
            add(p + "ffn_down_exps.weight", shape.hidden, n, e)
            if oss:
                norm(p + "ffn_gate_inp.bias", e)
                for name, width in (("ffn_gate_exps", n), ("ffn_up_exps", n), ("ffn_down_exps", shape.hidden)):
                    norm(f"{p}{name}.bias", width, e)
        else:
            add(p + "ffn_gate.weight", shape.intermediate, shape.hidden)
            add(p + "ffn_up.weight", shape.intermediate, shape.hidden)
            add(p + "ffn_down.weight", shape.hidden, shape.intermediate)
        norm(p + "attn_norm.weight")
        norm(p + "post_attention_norm.weight" if oss or delta else p + "ffn_norm.weight")

    def data(experts: int, rows: int, cols: int, t: str | None, gen: np.random.Generator = rng) -> np.ndarray:
        if t is None and experts:  # an expert bias per expert
            return (0.1 * gen.standard_normal((experts, cols))).astype(np.float32)
        if t is None:
            return (1 + 0.1 * gen.standard_normal(cols)).astype(np.float32)
        if t == "router":
            return gen.standard_normal((rows, cols), dtype=np.float32) * std
        if t == "negative":  # decay rates -exp(A_log), A_log ~ log(U(1, 16))
            return -gen.uniform(1.0, 16.0, cols).astype(np.float32)
        out = random_tensor(gen, max(experts, 1) * rows, cols, t, fast, std)
        return out.reshape(experts, rows, -1) if experts else out

    for name, experts, rows, cols, t in tensors:  # shapes first: the header precedes the data
        q_type = GGMLQuantizationType[t] if t not in (None, "router", "negative") else GGMLQuantizationType.F32
        probe = data(0, 1, cols, t, np.random.default_rng())  # one row: its dtype and bytes
        vector = t in (None, "negative")
        dims = ([experts] if experts else []) + ([rows] if not vector else []) + [probe.shape[-1]]
        nbytes = probe.nbytes * max(experts, 1) * (rows if not vector else 1)
        w.add_tensor_info(name, dims, probe.dtype, nbytes, raw_dtype=q_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, experts, rows, cols, t in tensors:  # in the order of the header
        w.write_tensor_data(data(experts, rows, cols, t))
    w.close()
    return path
