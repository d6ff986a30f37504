"""Gated DeltaNet's fused decode op (csrc/gated_delta_net.cpp) against the torch steps it replaces
(model_executor/layers/gated_delta_net.py and the Qwen3.5 layer's output gate)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.gated_delta_net import StateCache, causal_conv, l2norm, recurrent_step


def reference(p, rows, slots, fresh, cache, w, a_log, dt_bias, norm_w, hk, dk, tiled, eps):
    """The layer's torch steps for decode rows (Qwen3_5LinearLayer.mix), states updated in place."""
    hv, dv = cache.recurrent.shape[1], cache.recurrent.shape[3]
    c = w.shape[0]
    mixed, z, b, a = p[rows].split([c, hv * dv, hv, hv], dim=-1)
    beta, g = torch.sigmoid(b), -a_log.exp() * F.softplus(a + dt_bias)
    keep = torch.tensor([0.0 if f else 1.0 for f in fresh])
    idx = torch.tensor(slots)
    y, cache.conv[idx] = causal_conv(mixed.unsqueeze(-1), cache.conv[idx] * keep[:, None, None], w)
    y = y[..., 0]
    kd = hk * dk
    q, k, v = y.split([kd, kd, hv * dv], dim=-1)
    q, k = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk))
    r = hv // hk
    q, k = (torch.cat([q] * r, dim=-2), torch.cat([k] * r, dim=-2)) if tiled else \
        (q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2))
    q, k = l2norm(q) * dk ** -0.5, l2norm(k)
    o, cache.recurrent[idx] = recurrent_step(q, k, v.unflatten(-1, (hv, dv)), g, beta,
                                             cache.recurrent[idx] * keep[:, None, None, None])
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    return normed * F.silu(z.view(-1, hv, dv))


@pytest.mark.parametrize("tiled", [False, True])
def test_the_fused_decode_step_is_the_torch_steps(ops, tiled: bool) -> None:
    """Four steps of three sequences in five slots (one starting fresh in a slot that held another's state, rows out of
    slot order), K = 4, two value heads a key head: outputs and both states as the torch steps give them, to fp32
    rounding (the op sums in the same order; exp and rsqrt are the library's, not torch's)."""
    gen = torch.Generator().manual_seed(0)
    hk, dk, hv, dv, kern, eps = 2, 16, 4, 32, 4, 1e-6
    c = 2 * hk * dk + hv * dv
    w = torch.randn(c, kern, generator=gen) * 0.5
    a_log, dt_bias, norm_w = (torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen),
                              torch.rand(dv, generator=gen) + 0.5)
    ours, theirs = StateCache(5, c, kern, hv, dk, dv), StateCache(5, c, kern, hv, dk, dv)
    for cache in (ours, theirs):  # the slot the fresh sequence takes holds an older sequence's state
        cache.conv[3] = 7.0
        cache.recurrent[3] = -3.0
    slots = [4, 0, 3]
    for step in range(4):
        fresh = [False, False, step == 0]
        p = torch.randn(5, c + hv * dv + 2 * hv, generator=gen)  # five rows, the decodes at rows 3, 0, 4
        rows = [3, 0, 4]
        got = ops.gated_delta_decode(p, torch.tensor(rows), torch.tensor(slots), torch.tensor(fresh), ours.conv,
                                     ours.recurrent, w, a_log, dt_bias, norm_w, hk, dk, tiled, eps)
        want = reference(p, rows, slots, fresh, theirs, w, a_log, dt_bias, norm_w, hk, dk, tiled, eps)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.conv, theirs.conv, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours.recurrent, theirs.recurrent, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.recurrent[[1, 2]], torch.zeros(2, hv, dk, dv))  # untouched slots


def test_mismatched_states_are_refused(ops) -> None:
    cache = StateCache(2, 2 * 16 + 32, 4, 2, 8, 16)
    p = torch.zeros(1, cache.conv.shape[1] + 2 * 16 + 4)
    w = torch.zeros(cache.conv.shape[1], 4)
    with pytest.raises(RuntimeError, match="do not match one layer"):  # dk 16 against states of dk 8
        ops.gated_delta_decode(p, torch.tensor([0]), torch.tensor([0]), torch.tensor([False]), cache.conv,
                               cache.recurrent, w, torch.zeros(2), torch.zeros(2), torch.ones(16), 1, 16, False, 1e-6)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gated_delta_decode(p, torch.tensor([0]), torch.tensor([2]), torch.tensor([False]), cache.conv,
                               cache.recurrent, w, torch.zeros(2), torch.zeros(2), torch.ones(16), 2, 8, False, 1e-6)
