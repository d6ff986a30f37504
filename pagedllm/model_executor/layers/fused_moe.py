"""A mixture-of-experts feed-forward layer: a router picks `top_k` of `num_experts` SwiGLU experts per token,
each expert that was picked runs once on the rows routed to it (its own linears: dense panels or GGML blocks,
whatever the loader gave it), and the outputs are summed with the routing weights.

A decode step reads only the experts its tokens picked. Under tensor parallelism every expert is cut like a
dense MLP (gate/up rows and down columns split across ranks), so each rank does the same share of every
expert's work however the router distributes tokens; the ranks' partial sums are all-reduced once, after the
combine, not once per expert.
"""

from __future__ import annotations

import torch
from torch import nn

from ...distributed import TPGroup
from .backends import Activation
from .linear import PackedLinear
from .module import InferenceModule


class Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, 2 * intermediate_size, bias)
        self.down_proj = PackedLinear(intermediate_size, hidden_size, bias)


class FusedMoE(InferenceModule):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, bias: bool = False, act: Activation = "silu") -> None:
        """bias: the router and the experts' linears have biases (gpt-oss); act: the experts' gated activation."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize, self.act = num_experts, top_k, renormalize, act
        self.gate = PackedLinear(hidden_size, num_experts, bias)  # the router
        self.gate.quantizable = False  # routing decides which weights run at all: it stays in the run dtype
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size, bias) for _ in range(num_experts))
        self.reduce: TPGroup | None = None

    def route(self, h: torch.Tensor, decode_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in h's dtype, expert ids [T, top_k]): softmax over all experts in fp32, the top
        k, renormalized to sum to 1 where the model does so (Mixtral, Qwen3-MoE's norm_topk_prob)."""
        probs = torch.softmax(self.gate(h, decode_rows).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    def forward(self, h: torch.Tensor, decode_rows: int, backend) -> torch.Tensor:
        """h: [T, hidden] (the post-attention norm's output) -> [T, hidden]. decode_rows: the leading rows that
        compute output tokens; each expert is told how many of its rows are such rows (its rows keep h's
        order), so a row's result does not depend on the batch it came in."""
        weights, ids = self.route(h, decode_rows)
        out = backend.moe_experts(self, h, ids, weights, decode_rows)
        if out is None:
            out = self.run_experts(h, ids, weights, decode_rows, backend)
        if self.reduce is not None:
            self.reduce.all_reduce(out)
        return out.to(h.dtype)

    def run_experts(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, decode_rows: int,
                    backend) -> torch.Tensor:
        """Each picked expert on its rows, one module call at a time: [T, hidden] fp32."""
        flat = ids.flatten()  # [T * top_k]: token t's picks at t * top_k ...
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending within each
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k  # [T * top_k]
        pick_weights = weights.flatten()  # [T * top_k]
        out = torch.zeros_like(h, dtype=torch.float32)
        lo = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[lo:lo + n]
            picks = order[lo:lo + n]
            lo += n
            expert = self.experts[e]
            nd = int((rows < decode_rows).sum()) if decode_rows > 0 else decode_rows
            act = backend.gate_up_act(expert.gate_up_proj, h[rows], nd, self.act)  # [n, intermediate]
            y = expert.down_proj(act, nd)  # [n, hidden]
            out.index_add_(0, rows, (y * pick_weights[picks].unsqueeze(1)).float())
        return out
