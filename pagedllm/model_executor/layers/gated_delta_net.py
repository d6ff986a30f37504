"""Gated DeltaNet (Qwen3.5's linear attention): a fixed-size state per sequence instead of a KV entry per token.

Per value head the state S is a [Dk, Dv] matrix. Each token t decays it by exp(g_t), writes the part of v_t that
S does not already predict from k_t (the delta rule, at rate beta_t), then reads it with q_t:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

q and k are L2-normalized, q also scaled by Dk^-1/2. Before that a depthwise causal convolution (kernel K, SiLU)
runs over the projected q, k, v channels, so each sequence also keeps its last K - 1 inputs (the conv state).

Decodes take the recurrent step, batched over sequences. Prompts and prompt chunks take the chunked form: within
a chunk of C tokens the sequential writes are solved at once (a unit lower-triangular system, the "UT
transform"), and the state passes from chunk to chunk, so a chunked prefill continues exactly where the last
chunk's state left off. fp32 throughout (the state accumulates over the whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens solved at once by the chunked form


@dataclass
class StateSeq:
    """One sequence's rows in a step: its state slot, rows [q_start, q_start + n), and whether its state starts at
    zero (the first rows of its prompt)."""

    slot: int
    q_start: int
    n: int
    fresh: bool


class StateCache:
    """The states of one linear-attention layer, a slot per running sequence: conv [slots, C, K - 1] and
    recurrent [slots, Hv, Dk, Dv], fp32."""

    lossy = False

    def __init__(self, num_slots: int, conv_dim: int, kernel: int, num_v_heads: int, k_dim: int, v_dim: int,
                 device: torch.device | str = "cpu") -> None:
        self.conv = torch.zeros(num_slots, conv_dim, kernel - 1, device=device)
        self.recurrent = torch.zeros(num_slots, num_v_heads, k_dim, v_dim, device=device)

    def copy_slot(self, src: int, dst: int) -> None:
        self.conv[dst].copy_(self.conv[src])
        self.recurrent[dst].copy_(self.recurrent[src])

    @staticmethod
    def bytes_per_slot(conv_dim: int, kernel: int, num_v_heads: int, k_dim: int, v_dim: int) -> int:
        return 4 * (conv_dim * (kernel - 1) + num_v_heads * k_dim * v_dim)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, C, n] after state [B, C, K - 1]; weight [C, K]. Returns (SiLU of the depthwise causal conv [B, C, n],
    the last K - 1 inputs [B, C, K - 1])."""
    xx = torch.cat((state, x), dim=-1)  # [B, C, K - 1 + n]
    c = xx.shape[1]
    out = F.conv1d(xx.reshape(1, -1, xx.shape[-1]), weight.repeat(xx.shape[0], 1).unsqueeze(1),
                   groups=xx.shape[0] * c).view(xx.shape[0], c, -1)  # [B, C, n]
    return F.silu(out), xx[..., xx.shape[-1] - state.shape[-1]:]


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k [B, H, Dk] (normalized, q scaled), v [B, H, Dv], g, beta [B, H],
    state [B, H, Dk, Dv]. Returns (o [B, H, Dv], the new state)."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k.unsqueeze(-1)).sum(-2)  # [B, H, Dv]: S^T k
    state = state + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - predicted)).unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(-2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens of one sequence: q, k [H, n, Dk] (normalized, q scaled), v [H, n, Dv], g, beta [H, n], state
    [H, Dk, Dv]. Returns (o [H, n, Dv], the state after the last token); equal to n recurrent steps."""
    h, n, dk = k.shape
    pad = -n % chunk
    if pad:  # zero rows: g = 0 keeps the state, beta = 0 writes nothing, their outputs are dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    m = (n + pad) // chunk
    q, k, v = (t.reshape(h, m, chunk, -1) for t in (q, k, v))  # [H, m, C, D]
    g, beta = g.reshape(h, m, chunk), beta.reshape(h, m, chunk)
    gamma = g.cumsum(-1)  # [H, m, C]: log decay from the chunk's start to each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [H, m, C, C] i>=j
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # token i's write is v_i minus what the state predicts after the chunk's earlier writes: solving the unit lower
    # triangular system (I + L) W = X, L[i, j] = beta_i k_i.k_j exp(gamma_i - gamma_j) for j < i, gives them all
    system = (kb @ k.transpose(-1, -2) * decay).masked_fill(~causal.tril(-1), 0.0) + torch.eye(chunk, device=q.device)
    writes = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)  # [H, m, C, Dv]
    reads = torch.linalg.solve_triangular(system, kb * gamma.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = q @ k.transpose(-1, -2) * decay  # [H, m, C, C]: within the chunk
    q_decayed = q * gamma.exp().unsqueeze(-1)
    k_decayed = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)  # to the chunk's end
    out = torch.empty_like(writes)
    for c in range(m):
        u = writes[:, c] - reads[:, c] @ state  # [H, C, Dv]: the writes, less what the incoming state predicts
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ u
        state = state * gamma[:, c, -1].exp()[:, None, None] + k_decayed[:, c].transpose(-1, -2) @ u
    return out.reshape(h, m * chunk, -1)[:, :n], state


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
