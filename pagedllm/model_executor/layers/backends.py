"""The compute a decoder layer asks for, one implementation per backend, chosen once when the model is
set up: `CpuKernels` (the C++ ops: fused RMSNorm + residual, rope + K/V write + paged attention in one
call, the MLP's silu(gate) * up on packed weights) and `TorchReference` (plain torch in the model's dtype,
the oracle the kernels are tested against). The model never branches on which one it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...platforms.cpu import Ops
from ..attention import AttentionMetadata, attention_from_qkv, paged_attention
from ..kv_cache import KVCache
from .gated_delta_net import StateCache


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gated activation: gate clamped from above and up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)


Activation = str | ClampedSwiGLU  # "silu" (SwiGLU), "gelu_tanh" (GeGLU, tanh approximation)


def glu(gate_up: torch.Tensor, act: Activation) -> torch.Tensor:
    """[T, 2 I] (gate | up) -> act(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if isinstance(act, ClampedSwiGLU):
        return act(gate, up)
    if act == "silu":
        return F.silu(gate) * up
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unknown activation {act!r}")


class _QKNorm:
    def qk_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """RMSNorm over each head of q and of k, in place in qkv [T, (H + 2 KVH) D] (Qwen3, Gemma 3: before rope)."""
        t, hq, hk = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        for lo, width, weight in ((0, hq, q_weight), (hq, hk, k_weight)):
            rows = qkv[:, lo:lo + width].reshape(-1, head_dim).contiguous()  # [T * heads, D]: qkv rows are wider
            qkv[:, lo:lo + width] = self.rms_norm(weight, eps, rows, None)[0].view(t, width)


class TorchReference(_QKNorm):
    name = "torch"
    argmax_rows = None  # torch's argmax

    @staticmethod
    def to_host(t: torch.Tensor) -> torch.Tensor:
        """A step's logits where the sampler reads them (the host)."""
        return t.cpu()

    def mask_rows(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
        """Grammar masks: none of its own (xgrammar's apply does it)."""
        return False

    def moe_experts(self, moe: nn.Module, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    decode_rows: int) -> torch.Tensor | None:
        """A MoE layer's routed experts in one call, [T, hidden] fp32; None: no such op for these weights (the
        layer runs each expert itself)."""
        return None

    def gated_delta_decode(self, layer: nn.Module, p: torch.Tensor, rows: list[int], slots: list[int],
                           fresh: list[bool], cache: StateCache) -> torch.Tensor | None:
        """One decode token a sequence through a Gated DeltaNet layer (its states updated in place): the gated
        outputs [B, Hv, Dv], or None for the layer's torch steps."""
        return None

    def paged_ops(self, cache: KVCache, head_dim: int, heads_per_kv: int) -> tuple[Callable | None, bool]:
        """(the op that attends the paged rows in place, whether prefills take the chunk kernel): neither here;
        decodes and chunks gather their blocks for SDPA."""
        return None, False

    def rms_norm(self, weight: torch.Tensor, eps: float, x: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); without a residual, x is the residual stream."""
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype), x

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [n, D] fp32 tables -> [T, 1, D] in the activations' dtype."""
        return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)

    def attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int, cache: KVCache, meta: AttentionMetadata, scale: float,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """qkv: [T, (H + 2 KVH) D] -> [T, H, D]: rope, the K/V write, attention over the pool (sinks [H] fp32:
        each head's attention sink, or None)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.view(t, num_heads, head_dim)
        k = k.view(t, num_kv_heads, head_dim)
        v = v.view(t, num_kv_heads, head_dim)
        q = q * cos + rotate_half(q) * sin  # cos, sin: [T, 1, D]
        k = k * cos + rotate_half(k) * sin
        return paged_attention(q, k, v, cache, meta, scale, sinks)

    def gate_up_act(self, gate_up: nn.Linear, h: torch.Tensor, decode_rows: int,
                    act: Activation = "silu") -> torch.Tensor:
        """act(gate) * up of the fused gate_up projection: [T, intermediate]. act: silu (SwiGLU) or gelu_tanh
        (GeGLU with the tanh approximation: Gemma)."""
        out = gate_up(h) if gate_up.packed is None else gate_up.packed.matmul(h, decode_rows)
        return glu(out, act)

    def norm_linear(self, norm: nn.Module, linear: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None,
                    decode_rows: int, act: Activation | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(residual + x)), residual + x): a layer's norm and the projection it feeds (a backend may run
        them as one call); with act, the projection is a gate_up and gate_up_act's output is returned."""
        return _norm_then_linear(self, norm, linear, x, residual, decode_rows, act)


class CpuKernels(_QKNorm):
    name = "cpu"
    to_host = staticmethod(TorchReference.to_host)

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self.argmax_rows = ops.argmax_rows  # torch's is single-threaded: ~2.7 ms on 64 x 49k
        self._moe: dict[int, tuple] = {}  # id(layer) -> (its first expert's packed weight, the op's lists, the op)

    def mask_rows(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
        """Grammar masks in place: logits [R, V] fp32, bitmask [R, V / 32] int32 (one bit per token), row
        rows[i] keeps the tokens bitmask row rows[i] allows; ~16x xgrammar's CPU apply. False: not applied."""
        if logits.dtype != torch.float32 or logits.stride(-1) != 1:
            return False
        self.ops.mask_rows_(logits, bitmask, torch.tensor(rows, dtype=torch.long))
        return True

    def moe_experts(self, moe: nn.Module, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    decode_rows: int) -> torch.Tensor | None:
        """Experts in ggml block formats: the whole layer in the op (moe.cpp), no per-expert dispatch here."""
        first = moe.experts[0].gate_up_proj.packed
        cached = self._moe.get(id(moe))
        if cached is None or cached[0] is not first:  # built once per packing of the layer
            args = _ggml_expert_args(moe)
            cached = self._moe[id(moe)] = (first, args, self.ops.MoeExperts(*args) if args is not None else None)
        if cached[2] is None:
            return None
        return cached[2](h, ids, weights)  # every row on the integer dot: batch-invariant

    def gated_delta_decode(self, layer: nn.Module, p: torch.Tensor, rows: list[int], slots: list[int],
                           fresh: list[bool], cache: StateCache) -> torch.Tensor | None:
        """The whole step in one op (gated_delta_net.cpp): each state read and written once."""
        if p.dtype != torch.float32 or cache.recurrent.dtype != torch.float32:
            return None
        return self.ops.gated_delta_decode(
            p.contiguous(), torch.tensor(rows), torch.tensor(slots), torch.tensor(fresh), cache.conv, cache.recurrent,
            layer.conv_weight.float().view(layer.conv_dim, layer.kernel).contiguous(), layer.A_log.float().contiguous(),
            layer.dt_bias.float().contiguous(), layer.norm_weight.float().contiguous(), layer.hk, layer.dk, layer.tiled,
            layer.eps)

    def paged_ops(self, cache: KVCache, head_dim: int, heads_per_kv: int) -> tuple[Callable | None, bool]:
        """The op reads fp32, bf16, fp8 and q8_0 / q4_0 pools in place. A bf16 pool's prefills go to the chunk
        kernel (bf16 dot products) where the tiles fit: head dims of whole 8s, at most 48 query heads a KV head; an
        fp32 pool's to its fp32 tiles on CPUs without native bf16 dot products.
        An fp8 or integer pool's go there too where the CPU has native bf16 dot products; without them SDPA over
        the sequence's dequantized blocks was faster and keeps fp32 math (a 2,048-token prompt of the default model
        over a q8_0 pool on a Zen 3: see docs/design/kv-tiers.md)."""
        from ..kv_quant import FP8KVCache, IntKVCache

        if cache.k.dtype not in (torch.float32, torch.bfloat16) and not isinstance(cache, (FP8KVCache, IntKVCache)):
            return None, False
        tiles = head_dim % 8 == 0 and heads_per_kv <= 48
        if isinstance(cache, (FP8KVCache, IntKVCache)):
            return self.ops.paged_attention, tiles and self.ops.native_bf16
        # an fp32 pool's prompts on the kernel's fp32 tiles where there are no native bf16 dot products (an AVX2
        # host, where dtype=auto gives fp32 pools): the 6 x 16 FMA tile beat SDPA per sequence there; elsewhere
        # they stay on SDPA, unmeasured against it
        fp32 = cache.k.dtype == torch.float32 and not self.ops.native_bf16
        chunk = tiles and not cache.lossy and (cache.k.dtype == torch.bfloat16 or fp32)
        return self.ops.paged_attention, chunk

    def rms_norm(self, weight: torch.Tensor, eps: float, x: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The op adds x into `residual` in place and normalizes in the same pass."""
        if residual is None:
            return self.ops.rms_norm(x, weight, eps, None), x
        return self.ops.rms_norm(x, weight, eps, residual), residual

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The op reads the first half of each (duplicated) table row: [T, D / 2] fp32."""
        half = cos.shape[1] // 2
        return cos[positions, :half], sin[positions, :half]

    def attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int, cache: KVCache, meta: AttentionMetadata, scale: float,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        return attention_from_qkv(self.ops, qkv, cos, sin, num_heads, cache, meta, scale, sinks)  # [T, H, D]

    def gate_up_act(self, gate_up: nn.Linear, h: torch.Tensor, decode_rows: int,
                    act: Activation = "silu") -> torch.Tensor:
        if act == "silu":  # every linear is packed with the kernels
            return gate_up.packed.matmul_silu_and_mul(h, decode_rows)
        return glu(gate_up.packed.matmul(h, decode_rows), act)

    def norm_linear(self, norm: nn.Module, linear: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None,
                    decode_rows: int, act: Activation | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight format takes the norm into its call where it can (a decode step of a small model is ~200 op
        calls, and the Python between two calls costs more than a norm); a linear whose ranks communicate, or a
        gate_up of another activation, takes the two steps."""
        if linear.reduce is not None or linear.gather is not None or act not in (None, "silu"):
            return _norm_then_linear(self, norm, linear, x, residual, decode_rows, act)
        y = linear.packed.matmul_normed(x, residual, norm.weight, norm.eps, decode_rows, silu=act == "silu")
        return y, x if residual is None else residual


def _norm_then_linear(backend: Backend, norm: nn.Module, linear: nn.Linear, x: torch.Tensor,
                      residual: torch.Tensor | None, decode_rows: int,
                      act: Activation | None) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_linear as two steps: the backend's rms_norm, then the linear (or its gate_up_act)."""
    h, residual = backend.rms_norm(norm.weight, norm.eps, x, residual)
    return (linear(h, decode_rows) if act is None else backend.gate_up_act(linear, h, decode_rows, act)), residual


def _ggml_expert_args(moe: nn.Module) -> tuple | None:
    """MoeExperts' weight lists for a layer whose experts are all GGML weights with the same number of gate_up parts,
    with biases on all or none of them, and a SwiGLU (plain or clamped); None otherwise."""
    from .weight_formats import GGMLWeight

    if moe.act != "silu" and not isinstance(moe.act, ClampedSwiGLU):
        return None
    alpha, limit = (moe.act.alpha, moe.act.limit) if isinstance(moe.act, ClampedSwiGLU) else (0.0, 0.0)
    gu = [e.gate_up_proj.packed for e in moe.experts]
    dn = [e.down_proj.packed for e in moe.experts]
    if not all(isinstance(w, GGMLWeight) for w in gu + dn):
        return None
    biased = gu[0].bias is not None
    if any((w.bias is not None) != biased for w in gu + dn):
        return None
    parts = len(gu[0]._weights)
    if any(len(w._weights) != parts for w in gu) or any(len(w._weights) != 1 for w in dn):
        return None
    return ([t for w in gu for t in w._weights], [t for w in gu for t in w._types],
            [r for w in gu for r in w.rows_per_part], parts,
            [w._weights[0] for w in dn], [w._types[0] for w in dn], [w.rows_per_part[0] for w in dn],
            [w.bias for w in gu] if biased else [], [w.bias for w in dn] if biased else [], alpha, limit)


Backend = TorchReference | CpuKernels


def backend_for(ops: Ops | None) -> Backend:
    return CpuKernels(ops) if ops is not None else TorchReference()
