"""Capacity planning: the seed's KV arithmetic for any model config. No torch here.

KV bytes per token = 2 (K and V) x layers x num_kv_heads x head_dim x bytes per element (GQA
counts: only the KV heads are stored). Static serving reserves max_model_len per sequence; paging
holds what each sequence really uses, rounded up to one block; and where some layers attend over a sliding
window (Gemma 3, gpt-oss), those layers hold only their window (kv_spec.plan_kv_layout, as the engine lays
out its pool): the paged figures count that.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..config import parse_size
from ..core.kv_spec import KVLayout, KVSpec, PageParts, plan_kv_layout
from ..model_executor.layers.formats import FORMATS
from ..model_executor.models.config import GGUF_FIELDS, GGUFInfo, first_layer, per_layer_attention

KV_DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0}
INT_KV_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}  # per 32 values of a head: an fp16 scale, then the values
FP8_SCALE_BYTES = 2  # one bf16 scale per token and kv head (see kv_quant.py)


@dataclass
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    tie_word_embeddings: bool = False
    weights_bytes: int | None = None  # as deployed, when known
    num_experts: int = 0  # a mixture of experts: every layer's MLP is num_experts of moe_intermediate_size
    moe_intermediate_size: int = 0
    layer_windows: tuple[int | None, ...] = ()  # each KV layer's sliding window (None: full); () every one full
    state_layers: int = 0  # layers that keep a fixed state per sequence instead of KV (linear attention)
    state_bytes_per_seq: int = 0  # those layers' state, one sequence (fp32)
    layer_kv: tuple[tuple[int, int], ...] = ()  # each KV layer's (KV heads, head_dim) where they differ; () the above
    shared_kv_layers: int = 0  # layers that attend over an earlier layer's K/V and keep none (Gemma 4)

    def kv_specs(self) -> list[KVSpec]:
        """The layers that keep KV, as the engine's model declares them."""
        n = self.num_layers - self.state_layers - self.shared_kv_layers
        shapes = self.layer_kv or ((self.num_kv_heads, self.head_dim),) * n
        return [KVSpec(h, d, w) for (h, d), w in zip(shapes, self.layer_windows or (None,) * n)]

    @property
    def num_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        mlp = 3 * h * self.intermediate_size
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts  # experts + router
        per_layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h


PRESETS = {
    # the seed's examples: MHA (kv heads = heads), FP16 weights
    "seed-7b": ModelShape("seed-7b (LLaMA-7B shape)", 32, 4096, 32, 32, 128, 11008, 32000, 2048,
                          weights_bytes=14 * 10**9),
    "seed-13b": ModelShape("seed-13b (LLaMA-13B shape)", 40, 5120, 40, 40, 128, 13824, 32000, 4096,
                           weights_bytes=26 * 10**9),
    "smollm2-135m": ModelShape("SmolLM2-135M-Instruct", 30, 576, 9, 3, 64, 1536, 49152, 8192,
                               tie_word_embeddings=True),
}


def hf_layer_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers reads the config: `layer_types` where given, Gemma 3's
    one-global-in-`sliding_window_pattern` otherwise, Qwen2's `use_sliding_window`, else every layer."""
    window, n = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if window is None or cfg.get("use_sliding_window") is False:
        return ()
    if cfg.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in cfg["layer_types"] if t != "linear_attention")
    if str(cfg.get("model_type", "")).startswith("gemma3"):
        pattern = cfg.get("sliding_window_pattern") or 6
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(n))
    return (window,) * n


def linear_attention_state(cfg: dict) -> tuple[int, int]:
    """(layers, fp32 bytes per sequence) of Gated DeltaNet layers (Qwen3.5): a conv state of the last K - 1
    inputs of its q, k, v channels and a [Dk, Dv] recurrent state per value head."""
    n = sum(1 for t in cfg.get("layer_types") or () if t == "linear_attention")
    if not n:
        return 0, 0
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, k = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg.get("linear_conv_kernel_dim", 4)
    return n, n * 4 * ((2 * hk * dk + hv * dv) * (k - 1) + hv * dk * dv)


def shape_from_hf_config(cfg: dict, name: str) -> ModelShape:
    if "text_config" in cfg:  # a multimodal checkpoint: its language model
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **cfg["text_config"]}
    heads = cfg["num_attention_heads"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    state_layers, state_bytes = linear_attention_state(cfg)
    shape = ModelShape(name, cfg["num_hidden_layers"], cfg["hidden_size"], heads,
                       cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads,
                       cfg["intermediate_size"], cfg["vocab_size"], cfg.get("max_position_embeddings", 2048),
                       cfg.get("tie_word_embeddings", False), num_experts=experts,
                       moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                       layer_windows=hf_layer_windows(cfg), state_layers=state_layers,
                       state_bytes_per_seq=state_bytes)
    if str(cfg.get("model_type", "")).startswith("gemma4"):  # layers of their own shapes; shared layers keep no KV
        n, window = shape.num_layers, cfg.get("sliding_window")
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(n)]
        shapes, sources = per_layer_attention(cfg, types)
        own = [i for i in range(n) if sources[i] == i]
        shape.layer_kv = tuple((shapes[i][1], shapes[i][0]) for i in own)
        shape.layer_windows = tuple(window if types[i] == "sliding_attention" else None for i in own)
        shape.shared_kv_layers = n - len(own)
    return shape


# the sliding-window layers llama.cpp fixes in code per architecture (the file gives only the window)
GGUF_WINDOW_LAYERS = {"gemma3": lambda i: (i + 1) % 6 != 0, "gpt-oss": lambda i: i % 2 == 0}


def shape_from_gguf(path: Path) -> ModelShape:
    from ..model_executor.model_loader.gguf_file import open_gguf

    r = open_gguf(path)
    arch = r.fields["general.architecture"].contents()
    stored = sum(int(t.n_bytes) for t in r.tensors)  # what the engine holds: the file's formats, as stored

    def g(key: str, default=None):
        f = r.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else default

    heads, hidden = int(g("attention.head_count")), int(g("embedding_length"))
    vocab = g("vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data)
    layers, window = int(g("block_count")), g("attention.sliding_window")
    tied = not any(t.name == "output.weight" for t in r.tensors)
    if arch in GGUF_FIELDS:  # layers of their own shapes or kinds, read as the loader reads them
        meta = {k: f.contents() for k, f in r.fields.items() if k.startswith(f"{arch}.")}
        fields = GGUF_FIELDS[arch](GGUFInfo(arch, meta, {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}))
        cfg = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "vocab_size": vocab,
               "num_key_value_heads": first_layer(g("attention.head_count_kv", heads)),
               "head_dim": g("attention.key_length", hidden // heads),
               "intermediate_size": first_layer(g("feed_forward_length")),
               "max_position_embeddings": int(g("context_length", 2048)),
               "tie_word_embeddings": tied, "sliding_window": window, "num_experts": g("expert_count"),
               "moe_intermediate_size": g("expert_feed_forward_length"), **fields}
        return replace(shape_from_hf_config(cfg, path.stem), weights_bytes=stored)
    sliding = GGUF_WINDOW_LAYERS.get(arch)
    windows = tuple(int(window) if sliding(i) else None for i in range(layers)) if window and sliding else ()
    return ModelShape(path.stem, layers, hidden, heads, int(g("attention.head_count_kv", heads)),
                      int(g("attention.key_length", hidden // heads)), int(g("feed_forward_length")), int(vocab),
                      int(g("context_length", 2048)), tied, weights_bytes=stored, layer_windows=windows)


def load_shape(model: str | None = None, preset: str | None = None) -> ModelShape:
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
        return PRESETS[preset]
    if model is None:
        return PRESETS["smollm2-135m"]
    p = Path(model)
    if p.suffix == ".gguf":
        return shape_from_gguf(p)
    cfg_path = p / "config.json" if p.is_dir() else p
    return shape_from_hf_config(json.loads(cfg_path.read_text()), p.name if p.is_dir() else p.parent.name)


def _head_bytes(fmt: str, head_dim: int, scale: bool = True) -> float:
    """One K or V head vector of one token: q8_0 / q4_0 blocks of 32 values, or dtype bytes (+ fp8's scale)."""
    if fmt in INT_KV_BLOCK_BYTES:
        return -(-head_dim // 32) * INT_KV_BLOCK_BYTES[fmt]
    return head_dim * KV_DTYPE_BYTES[fmt] + (FP8_SCALE_BYTES if scale and fmt.startswith("fp8") else 0)


def _page_parts(kv_dtype: str) -> PageParts:
    """A layer's K and V bytes of a token as the engine's pages hold them (fp8 scales apart)."""
    k, _, v = kv_dtype.partition("/")
    return lambda spec: tuple(int(spec.num_kv_heads * _head_bytes(f, spec.head_dim, False)) for f in (k, v or k))


def _page_bytes(specs: list[KVSpec | None], layout: KVLayout, kv_dtype: str) -> int:
    """One token's bytes of a block id: a page of every slot, and the fp8 scales of layers in other shapes' pages."""
    pages = layout.slot_specs(specs)
    own = sum(m * 2 * s.num_kv_heads * FP8_SCALE_BYTES for page, kinds in zip(pages, layout.slot_kinds(specs))
              for s, m in kinds.items() if (s.num_kv_heads, s.head_dim) != (page.num_kv_heads, page.head_dim))
    return _token_bytes(pages, kv_dtype) + (own if kv_dtype.startswith("fp8") else 0)


def check_kv_dtype(kv_dtype: str) -> None:
    k, _, v = kv_dtype.partition("/")
    ok = k in KV_DTYPE_BYTES or k in INT_KV_BLOCK_BYTES if not v else k in INT_KV_BLOCK_BYTES and v in INT_KV_BLOCK_BYTES
    if not ok:
        raise ValueError(f"kv dtype must be one of {sorted(KV_DTYPE_BYTES) + sorted(INT_KV_BLOCK_BYTES)} or K/V "
                         f"integer formats such as q8_0/q4_0, got {kv_dtype!r}")


def _token_bytes(specs: list[KVSpec], kv_dtype: str) -> int:
    """One token's K and V in these layers. kv_dtype: one format for K and V, or "K/V" integer formats."""
    k, _, v = kv_dtype.partition("/")
    return int(sum(s.num_kv_heads * (_head_bytes(k, s.head_dim) + _head_bytes(v or k, s.head_dim)) for s in specs))


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """kv_dtype: one format for K and V, or "K/V" integer formats (q8_0/q4_0)."""
    return _token_bytes(shape.kv_specs(), kv_dtype)


def kv_bytes_per_sequence(shape: ModelShape, kv_dtype: str, num_tokens: int, block_size: int,
                          hybrid: bool = True) -> int:
    """The paged KV one sequence of num_tokens holds while it decodes: every layer's blocks, or with the
    hybrid layout a full-attention group's every block and a sliding group's window (the engine's pages)."""
    specs = shape.kv_specs()
    layout = plan_kv_layout(specs, hybrid, _page_parts(kv_dtype))
    page = _page_bytes(specs, layout, kv_dtype)  # a block id is one page across the slot tensors
    blocks = 0
    for g in layout.groups:
        held = -(-num_tokens // block_size)
        if g.sliding_window is not None:  # the blocks before the next token's window are gone
            held -= max(0, num_tokens - g.sliding_window + 1) // block_size
        blocks += held
    return blocks * block_size * page + shape.state_bytes_per_seq


def layout_summary(shape: ModelShape) -> str:
    kinds: dict[int | None, int] = {}
    for s in shape.kv_specs():
        kinds[s.sliding_window] = kinds.get(s.sliding_window, 0) + 1
    summary = ", ".join(f"{n} {'full' if w is None else f'window {w}'}" for w, n in kinds.items())
    summary += f", {shape.state_layers} linear attention" if shape.state_layers else ""
    return summary + (f", {shape.shared_kv_layers} reading an earlier layer's KV" if shape.shared_kv_layers else "")


@dataclass
class Plan:
    model: str
    kv_dtype: str
    block_size: int
    max_model_len: int
    kv_bytes_per_token: int
    kv_bytes_per_seq_max_len: int
    memory_bytes: int
    weights_bytes: int
    activation_bytes: int
    kv_budget_bytes: int
    mean_prompt: int
    mean_output: int
    kv_bytes_per_seq_paged: int
    max_seqs_static: int
    max_seqs_paged: int
    static_utilization: float  # tokens really used / tokens reserved, at the expected lengths
    paged_utilization: float
    concurrency: int | None = None  # when asked: the KV that many sequences need both ways
    kv_bytes_static_at_concurrency: int | None = None
    kv_bytes_paged_at_concurrency: int | None = None
    layers: str = ""  # its layers by attention kind
    kv_bytes_per_seq_every_layer: int | None = None  # paged, had every layer kept every token (sliding models)

    def to_dict(self) -> dict:
        return asdict(self)


def plan(shape: ModelShape, memory: str | int, kv_dtype: str = "float16", block_size: int = 16,
         max_model_len: int | None = None, weights_memory: str | int | None = None,
         activation_memory: str | int | None = 0, mean_prompt: int = 512, mean_output: int = 256,
         weight_dtype_bytes: float | None = None, concurrency: int | None = None,
         weight_format: str | None = None) -> Plan:
    """weight_format: the weights' storage format (f32, bf16, q8_0, q4_0, q4_k, ...): parameters x its
    bytes per weight; default: as deployed (a GGUF's own formats; the presets' fp16), else 2 bytes."""
    check_kv_dtype(kv_dtype)
    max_len = max_model_len or shape.max_model_len
    mem = parse_size(memory)
    if weights_memory is not None:
        weights = parse_size(weights_memory)
    elif weight_format is not None:
        if weight_format not in FORMATS:
            raise ValueError(f"weight format must be one of {sorted(FORMATS)}, got {weight_format!r}")
        weights = int(shape.num_params * FORMATS[weight_format].bytes_per_weight)
    else:
        wbytes = weight_dtype_bytes or (4 if kv_dtype == "float32" else 2)
        weights = shape.weights_bytes or shape.num_params * wbytes
    act = parse_size(activation_memory) if activation_memory else 0
    budget = mem - weights - act
    if budget <= 0:
        raise ValueError(f"nothing left for KV: memory {mem} - weights {weights} - activations {act} <= 0")
    per_tok = kv_bytes_per_token(shape, kv_dtype)
    per_seq_max = per_tok * max_len + shape.state_bytes_per_seq
    used = min(max_len, mean_prompt + mean_output)
    blocks = -(-used // block_size)
    per_seq_paged = kv_bytes_per_sequence(shape, kv_dtype, used, block_size)
    every_layer = kv_bytes_per_sequence(shape, kv_dtype, used, block_size, hybrid=False)
    return Plan(shape.name, kv_dtype, block_size, max_len, per_tok, per_seq_max, mem, weights, act, budget,
                mean_prompt, mean_output, per_seq_paged, budget // per_seq_max, budget // per_seq_paged,
                used / max_len, used / (blocks * block_size), concurrency,
                concurrency * per_seq_max if concurrency else None,
                concurrency * per_seq_paged if concurrency else None, layout_summary(shape),
                every_layer if every_layer != per_seq_paged else None)


def format_plan(p: Plan) -> str:
    gb = 1e9
    lines = [
        f"model                      {p.model} (layers: {p.layers})",
        f"KV bytes per token         {p.kv_bytes_per_token:,} B ({p.kv_dtype})",
        f"KV per sequence @ {p.max_model_len:<8} {p.kv_bytes_per_seq_max_len / gb:.3f} GB",
        f"memory                     {p.memory_bytes / gb:.1f} GB = weights {p.weights_bytes / gb:.1f} GB"
        f" + activations {p.activation_bytes / gb:.1f} GB + KV budget {p.kv_budget_bytes / gb:.1f} GB",
        f"expected tokens per seq    {p.mean_prompt} prompt + {p.mean_output} output",
        "",
        f"{'':26} {'static (max-length)':>20} {'paged (block ' + str(p.block_size) + ')':>20}",
        f"{'KV reserved per sequence':26} {p.kv_bytes_per_seq_max_len / gb:>18.3f}GB {p.kv_bytes_per_seq_paged / gb:>18.3f}GB",
        f"{'concurrent sequences':26} {p.max_seqs_static:>20} {p.max_seqs_paged:>20}",
        f"{'KV utilization':26} {p.static_utilization:>19.1%} {p.paged_utilization:>19.1%}",
    ]
    if p.concurrency:
        lines.append(f"{'KV for ' + str(p.concurrency) + ' sequences':26} "
                     f"{p.kv_bytes_static_at_concurrency / gb:>18.1f}GB {p.kv_bytes_paged_at_concurrency / gb:>18.1f}GB")
    if p.kv_bytes_per_seq_every_layer:
        lines.append(f"\nsliding-window layers keep their window: {p.kv_bytes_per_seq_paged / gb:.3f} GB per sequence "
                     f"instead of {p.kv_bytes_per_seq_every_layer / gb:.3f} GB "
                     f"({p.kv_bytes_per_seq_every_layer / p.kv_bytes_per_seq_paged:.1f}x the sequences)")
    if p.max_seqs_static:
        lines.append(f"\npaging fits {p.max_seqs_paged / p.max_seqs_static:.1f}x the concurrent sequences")
    return "\n".join(lines)
