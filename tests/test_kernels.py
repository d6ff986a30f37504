"""The C++ ops against their torch definitions (the model-level HF parity tests cover them too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import load_ops, pack_weight, pad_bias, unpack_weight
from pagedllm.models.llama import rotate_half


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    ops = load_ops()
    assert ops is not None, "the C++ ops build on this machine"
    return ops


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 64, 200])
@pytest.mark.parametrize("out_features", [48, 70, 96])
def test_packed_linear(ops, rows, out_features):  # noqa: ANN001
    """Full and partial 48-column panels, full and partial 8-row tiles, with and without bias."""
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 40, generator=g), torch.randn(out_features, 40, generator=g)
    b = torch.randn(out_features, generator=g)
    packed = pack_weight(w)
    assert packed.shape == (-(-out_features // 48), 40, 48)
    assert torch.equal(unpack_weight(packed, out_features), w)
    torch.testing.assert_close(ops.packed_linear(x, packed, pad_bias(b), out_features), F.linear(x, w, b))
    torch.testing.assert_close(ops.packed_linear(x, packed, None, out_features), F.linear(x, w))


def test_rms_norm_with_and_without_residual(ops):  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g), torch.randn(40, generator=g)

    def ref(v: torch.Tensor) -> torch.Tensor:
        return w * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)

    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5, None), ref(x))
    stream = res.clone()
    out = ops.rms_norm(x, w, 1e-5, stream)
    torch.testing.assert_close(stream, res + x)  # the residual stream is updated in place
    torch.testing.assert_close(out, ref(res + x))


def test_rope_in_place_on_q_and_k_heads(ops):  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    t, h, kvh, d = 6, 4, 2, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    ang = torch.randn(t, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).unsqueeze(1), torch.cat([ang.sin()] * 2, -1).unsqueeze(1)
    heads = qkv[:, :(h + kvh) * d].view(t, h + kvh, d)
    expected = torch.cat([heads * cos + rotate_half(heads) * sin, qkv[:, (h + kvh) * d:].view(t, kvh, d)], 1)
    ops.rope_(qkv, ang.cos().contiguous(), ang.sin().contiguous(), h + kvh, d)
    torch.testing.assert_close(qkv.view(t, -1, d), expected)  # v heads untouched


def test_argmax_rows_first_maximum_and_inf(ops):  # noqa: ANN001
    x = torch.randn(7, 1000, generator=torch.Generator().manual_seed(0))
    x[1, 10] = x[1, 500] = 100.0  # tie: the first index wins, as in torch.argmax
    x[2, :] = float("-inf")
    x[2, 999] = 0.0
    x[3, 0] = 50.0
    assert ops.argmax_rows(x).tolist() == x.argmax(-1).tolist()
    assert ops.argmax_rows(x)[1].item() == 10 and ops.argmax_rows(x)[2].item() == 999


def test_silu_and_mul(ops):  # noqa: ANN001
    x = torch.randn(3, 2 * 50, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :50]) * x[:, 50:])
