"""The ggml block-format kernels (csrc/linear_ggml.cpp) against gguf-py's reference dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4]


def random_blocks(t: T, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """[rows, row_bytes] uint8: gguf-py's quantizer where it has one, else random bytes with finite
    fp16 scales (every bit pattern of a K-quant block's quants and 6-bit scales is a valid block)."""
    rng = np.random.default_rng(seed)
    if t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4):
        return quantize(rng.standard_normal((rows, k)).astype(np.float32) * 0.05, t)
    qk, nbytes = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, k // qk, nbytes), dtype=np.uint8)

    def fp16(scale: float) -> np.ndarray:
        return (rng.random((rows, k // qk)) * scale + scale / 10).astype(np.float16).view(np.uint8).reshape(
            rows, k // qk, 2)

    if t == T.Q6_K:
        raw[..., 208:210] = fp16(0.002)
    else:
        raw[..., 0:2], raw[..., 2:4] = fp16(0.01), fp16(0.01)
    return raw.reshape(rows, -1)


def quantized_activations(x: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """x rounded as the integer dot sees it: per 32 values, int8 (or int16: levels 32767) with scale
    max|x| / levels, in the kernel's fp32 arithmetic (q = x * (levels / max|x|) rounded to nearest even), so
    that a value near a rounding boundary rounds as it does there."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, levels / torch.where(amax > 0, amax, 1), 0)
    q = torch.round(blocks * inv)
    return (q.double() * (amax / levels).double()).view(m, k)


@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
def test_dequantize_is_bit_exact(ops, t: T) -> None:
    raw = random_blocks(t, 37, 512)
    ref = dequantize(raw, t).reshape(37, 512)
    out = ops.dequantize_ggml(torch.from_numpy(raw), int(t), 512, 37, None)
    assert torch.equal(out, torch.from_numpy(ref))


@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("k", [512, 96])
def test_integer_dot_equals_the_product_of_quantized_activations(ops, t: T, m: int, k: int) -> None:
    """Decode-sized batches: exactly ggml's arithmetic (int8 activations per 32) up to fp32 summation
    order; so the only error against fp32 is the activations' rounding, measured below. k = 96: an
    odd number of 32-chunks per row (the AVX-512 path takes chunk pairs, such rows take 256-bit)."""
    if k % GGML_QUANT_SIZES[t][0]:
        pytest.skip("K-quant rows are whole 256-blocks")
    o = 61
    raw = random_blocks(t, o, k, seed=m)
    w = torch.from_numpy(dequantize(raw, t).reshape(o, k)).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(o)
    y = ops.linear_ggml(x, [torch.from_numpy(raw)], [int(t)], [o], bias, o)
    exact = quantized_activations(x) @ w.T + bias.double()
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    fp32 = x.double() @ w.T + bias.double()
    assert ((y.double() - fp32).norm() / fp32.norm()).item() < 0.01  # int8 activations: ~0.5% here


@pytest.mark.parametrize("t", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [40, 300])
def test_prefill_path_is_the_bf16_product_of_the_dequantized_weights(ops, t: T, m: int) -> None:
    """m = 40: one pass over x per panel; m = 300: panels made in groups, x swept in 128-row blocks.
    100 rows: two full 48-row panels and a partial one. Prompt rows (decode_rows = 0); on AVX2 the panels are fp32
    (no bf16 arithmetic there): the product of x and the weights as ggml dequantizes them."""
    o, k = 100, 512
    raw = random_blocks(t, o, k)
    w = torch.from_numpy(dequantize(raw, t).reshape(o, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    y = ops.linear_ggml(x, [torch.from_numpy(raw)], [int(t)], [o], None, o, 0)
    if ops.linear_ggml_isa == "avx2":
        ref = x.double() @ w.double().T
        tol = 1e-6  # fp32 sums of 512 products
    else:
        ref = x.bfloat16().double() @ w.bfloat16().double().T
        tol = 1e-4
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_bad_inputs_are_clear_errors(ops) -> None:
    raw = torch.from_numpy(random_blocks(T.Q4_0, 8, 64))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear_ggml(torch.randn(1, 96), [raw], [int(T.Q4_0)], [8], None, 8)
    with pytest.raises(RuntimeError, match="no kernel"):
        ops.linear_ggml(torch.randn(1, 64), [raw], [int(T.IQ4_NL)], [8], None, 8)


@pytest.mark.parametrize("m", [2, 40])
def test_parts_of_different_formats_stack_along_the_outputs(ops, m: int) -> None:
    """A fused q/k/v of a Q4_K_M file: Q4_K and Q6_K parts, one call, columns in part order."""
    k = 512
    parts = [(random_blocks(T.Q4_K, 40, k, seed=1), T.Q4_K), (random_blocks(T.Q6_K, 24, k, seed=2), T.Q6_K),
             (random_blocks(T.Q8_0, 8, k, seed=3), T.Q8_0)]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(72)
    y = ops.linear_ggml(x, [torch.from_numpy(r) for r, _ in parts], [int(t) for _, t in parts], [40, 24, 8], bias, 72)
    singles = [ops.linear_ggml(x, [torch.from_numpy(r)], [int(t)], [r.shape[0]], None, r.shape[0]) for r, t in parts]
    assert torch.equal(y, torch.cat(singles, dim=1) + bias)


@pytest.mark.parametrize("m,decode_rows", [(1, 1), (5, 5), (40, 0), (300, 0)])
def test_the_fused_gate_up_call_is_the_two_calls(ops, m: int, decode_rows: int) -> None:
    """linear_ggml_silu_mul writes exactly silu_and_mul(linear_ggml(...)) on every path (the dot, the tiles, the
    panels), for a gate and an up part of different formats, with a bias."""
    k = 256
    parts = [torch.from_numpy(random_blocks(T.Q4_K, 48, k, seed=4)), torch.from_numpy(random_blocks(T.Q8_0, 48, k, seed=5))]
    args = (parts, [int(T.Q4_K), int(T.Q8_0)], [48, 48], torch.randn(96), 96, decode_rows)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    fused = ops.linear_ggml_silu_mul(x, *args)
    assert fused.shape == (m, 48) and torch.equal(fused, ops.silu_and_mul(ops.linear_ggml(x, *args)))


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("m,decode_rows", [(1, 1), (40, 0)])
def test_the_normed_call_is_the_norm_then_the_linear(ops, m: int, decode_rows: int, silu: bool,
                                                     with_residual: bool) -> None:
    """linear_ggml_normed: rms_norm (x added into the residual in place first, where given), then linear_ggml, then
    silu_and_mul where asked; the same bits and the same residual as those calls one by one."""
    k = 256
    g = torch.Generator().manual_seed(6)
    parts = [torch.from_numpy(random_blocks(T.Q4_0, 48, k, seed=6)), torch.from_numpy(random_blocks(T.Q6_K, 48, k, seed=7))]
    args = (parts, [int(T.Q4_0), int(T.Q6_K)], [48, 48], None, 96, decode_rows)
    x, w = torch.randn(m, k, generator=g), torch.rand(k, generator=g) + 0.5
    res_a = torch.randn(m, k, generator=g) if with_residual else None
    res_b = res_a.clone() if with_residual else None
    fused = ops.linear_ggml_normed(x, res_a, w, 1e-6, *args, silu)
    y = ops.linear_ggml(ops.rms_norm(x, w, 1e-6, res_b), *args)
    assert torch.equal(fused, ops.silu_and_mul(y) if silu else y)
    assert not with_residual or torch.equal(res_a, res_b)


REPACKABLE = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4]


@pytest.mark.parametrize("t", REPACKABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 6, 40, 150, 300])
def test_repacked_16_row_groups_match_the_file_layout(ops, t: T, m: int) -> None:
    """Where the CPU runs Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K / MXFP4 repacked (AVX-512 VNNI; Q4_0 / Q4_1 / Q8_0 on
    AVX2): 37 rows = two groups of 16 and a padded one. The integer dot takes int16 activations (per 32, scale
    max|x| / 32767; int8 on AVX2), so it is the exact product up to that rounding; the panels are the same values
    as from the file's layout; dequantization and row lookups are bit-exact."""
    if not ops.ggml_repacks(int(t)):
        pytest.skip("this CPU runs the file's layout only")
    o, k = 37, 512
    raw = torch.from_numpy(random_blocks(t, o, k, seed=m))
    packed = ops.repack_ggml(raw, int(t))
    assert packed.shape == (3, k // 32, {T.Q4_0: 288, T.Q4_1: 320, T.Q8_0: 544, T.Q4_K: 296, T.Q6_K: 548,
                                        T.MXFP4: 272}[t])
    ref_w = ops.dequantize_ggml(raw, int(t), k, o, None)
    assert torch.equal(ops.dequantize_ggml(packed, int(t) + 1000, k, o, None), ref_w)
    ids = torch.tensor([36, 0, 17, 17])
    assert torch.equal(ops.dequantize_ggml(packed, int(t) + 1000, k, o, ids), ref_w[ids])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(o)
    plain = ops.linear_ggml(x, [raw], [int(t)], [o], bias, o)
    y = ops.linear_ggml(x, [packed], [int(t) + 1000], [o], bias, o)
    if ops.linear_ggml_isa == "avx2":  # steps of decodes alone of any size: int8 activations (ggml's AVX2 dot)
        exact = quantized_activations(x) @ ref_w.double().T + bias.double()
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
        # prompt rows: fp32 panels from either layout, the same bits
        prompt = [ops.linear_ggml(x, [w], [tt], [o], bias, o, 0) for w, tt in ((raw, int(t)), (packed, int(t) + 1000))]
        assert torch.equal(prompt[0], prompt[1])
    elif m < 16:  # the integer dot runs below 16 rows (linear_ggml.cpp kDotRowsMax), else bf16 panels
        exact = quantized_activations(x, 32767) @ ref_w.double().T + bias.double()  # int16 activations
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
        fp32 = x.double() @ ref_w.double().T + bias.double()
        assert ((y.double() - fp32).norm() / fp32.norm()).item() < 1e-4  # measured ~2e-5: the weights' own error
    else:
        assert torch.equal(y, plain)


@pytest.mark.slow
def test_fallback_isa_paths(ops_avx2) -> None:
    """What a CPU without AVX-512 compiles (Zen 3: AVX2), built here by masking this CPU's flags: the
    file layout (every format runs it; Q4_0 / Q4_1 / Q8_0 are repacked at load, below), the same references as
    above. Steps of decodes alone take the one-row dot under 16 rows and the tiled dot (int8 activations too)
    under 64; prompt rows and larger steps fp32 panels (no bf16 arithmetic to gain from: the weights as ggml
    dequantizes them, x as it is), the same bits for a row in a batch of any size. (The scalar path, for CPUs
    without AVX2, builds with -mno-avx2 too; measured once, not run every time: 1 minute.)"""
    mod = ops_avx2
    assert mod.linear_ggml_isa == "avx2"
    assert [t.name for t in REPACKABLE if mod.ggml_repacks(int(t))] == ["Q4_0", "Q4_1", "Q8_0"]
    k = 512
    for t in (T.Q4_0, T.Q4_1, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4):
        raw = random_blocks(t, 41, k, seed=int(t))  # an odd row count: the tiles' last weight row is alone
        w = torch.from_numpy(dequantize(raw, t).reshape(41, k)).double()
        assert torch.equal(mod.dequantize_ggml(torch.from_numpy(raw), int(t), k, 41, None), w.float())
        for m, decode_rows in [(3, -1), (22, -1), (22, 0), (70, -1)]:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = mod.linear_ggml(x, [torch.from_numpy(raw)], [int(t)], [41], None, 41, decode_rows).double()
            int8 = m < 64 and decode_rows != 0
            ref = quantized_activations(x) @ w.T if int8 else x.double() @ w.T
            tol = 1e-4 if int8 else 1e-6  # fp32 sums of 512 products
            torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())
            if not int8:
                few = mod.linear_ggml(x[:3].contiguous(), [torch.from_numpy(raw)], [int(t)], [41], None, 41, 0)
                assert torch.equal(few.double(), y[:3])
                bias = torch.randn(41, generator=torch.Generator().manual_seed(41))  # 41: a partial last panel
                yb = mod.linear_ggml(x, [torch.from_numpy(raw)], [int(t)], [41], bias, 41, decode_rows).double()
                torch.testing.assert_close(yb, ref + bias.double(), rtol=tol, atol=tol * ref.abs().max().item())
        # a tile's lanes do not mix: the same decode rows give the same bits in a step of 22 or of 17
        x = torch.randn(22, k, generator=torch.Generator().manual_seed(22))
        tiles = [mod.linear_ggml(x[:n], [torch.from_numpy(raw)], [int(t)], [41], None, 41, n) for n in (22, 17)]
        assert torch.equal(tiles[0][:17], tiles[1])


@pytest.mark.slow
@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_repacked_groups_as_an_avx2_cpu_runs_them(ops_avx2, t: T) -> None:
    """Q4_0 / Q4_1 / Q8_0 repacked on AVX2 (the 16-row groups read as halves of 8 rows, one row per lane): 37 rows =
    two groups and 5 rows of a third, whose second half is all padding. Steps of decodes alone of any size take the
    integer dot (int8 activations, as the file layout's dot and tiles), each row the same bits in a step of any
    size; prompt rows the fp32 panels, the same bits as from the file's layout."""
    _repacked_on_256_bit_dots(ops_avx2, t)


@pytest.mark.slow
def test_repacked_groups_as_an_avx_vnni_cpu_runs_them(tmp_path) -> None:
    """The same on a CPU with AVX-VNNI but no AVX-512 (Alder Lake and later client cores), whose repacked dot takes
    vpdpbusd: linear_ggml.cpp and linear_x16.cpp alone, built with AVX-512 masked (~30 s)."""
    from pathlib import Path

    from torch.utils.cpp_extension import load

    import pagedllm
    from pagedllm.platforms.cpu import cpu_isa_flags

    if "avx_vnni" not in cpu_isa_flags().split():
        pytest.skip("this CPU has no AVX-VNNI")
    csrc = Path(pagedllm.__file__).parent / "platforms" / "csrc"
    stub = tmp_path / "stub.cpp"
    stub.write_text('#include <torch/extension.h>\n#include "linear_ggml.h"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n'
                    '  m.def("linear_ggml", &linear_ggml); m.def("repack_ggml", &repack_ggml);\n'
                    '  m.def("dequantize_ggml", &dequantize_ggml); m.def("ggml_repacks", &ggml_repacks);\n'
                    '  m.def("isa", &linear_ggml_isa);\n}\n')
    mod = load(name="pagedllm_ggml_avx_vnni", sources=[str(csrc / "linear_ggml.cpp"), str(csrc / "linear_x16.cpp"),
                                                       str(stub)],
               extra_cflags=["-O2", "-march=native", "-mno-avx512f", "-mno-amx-tile"], extra_include_paths=[str(csrc)],
               build_directory=str(tmp_path), verbose=False)
    assert mod.isa() == "avx_vnni" and all(mod.ggml_repacks(int(t)) for t in (T.Q4_0, T.Q4_1, T.Q8_0))
    for t in (T.Q4_0, T.Q4_1, T.Q8_0):
        _repacked_on_256_bit_dots(mod, t)


def _repacked_on_256_bit_dots(mod, t: T) -> None:
    o, k = 37, 512
    raw = torch.from_numpy(random_blocks(t, o, k, seed=int(t)))
    packed = mod.repack_ggml(raw, int(t))
    w = torch.from_numpy(dequantize(raw.numpy(), t).reshape(o, k)).double()
    assert torch.equal(mod.dequantize_ggml(packed, int(t) + 1000, k, o, None), w.float())
    bias = torch.randn(o, generator=torch.Generator().manual_seed(o))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(70))
    for m, decode_rows in [(1, -1), (2, -1), (3, -1), (5, -1), (16, -1), (22, -1), (70, -1), (3, 0), (22, 0), (70, 0)]:
        y = mod.linear_ggml(x[:m], [packed], [int(t) + 1000], [o], bias, o, decode_rows)
        plain = mod.linear_ggml(x[:m], [raw], [int(t)], [o], bias, o, decode_rows)
        if decode_rows != 0:
            ref = quantized_activations(x[:m]) @ w.T + bias.double()
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            one = mod.linear_ggml(x[m - 1:m], [packed], [int(t) + 1000], [o], bias, o, 1)
            assert torch.equal(one[0], y[m - 1])  # a row's lanes do not depend on the rows beside it
        else:
            assert torch.equal(y, plain)


@pytest.mark.slow
def test_repacked_experts_as_an_avx2_cpu_runs_them(ops_avx2) -> None:
    """The fused MoE op over experts repacked on AVX2 (each stage one parallel region over their groups, the int8
    activations of each expert's rows gathered from the batch's) against the same experts in the file's layout:
    the same int8 products, summed in another order."""
    mod = ops_avx2
    experts, hidden, inter = 4, 64, 32
    gate_up = [torch.from_numpy(random_blocks(T.Q4_0, 2 * inter, hidden, seed=e)) for e in range(experts)]
    down = [torch.from_numpy(random_blocks(T.Q8_0, hidden, inter, seed=10 + e)) for e in range(experts)]

    def op(repack: bool):
        gu = [mod.repack_ggml(w, int(T.Q4_0)) if repack else w for w in gate_up]
        dn = [mod.repack_ggml(w, int(T.Q8_0)) if repack else w for w in down]
        shift = 1000 if repack else 0
        return mod.MoeExperts(gu, [int(T.Q4_0) + shift] * experts, [2 * inter] * experts, 1, dn,
                              [int(T.Q8_0) + shift] * experts, [hidden] * experts, [], [], 0.0, 0.0)

    h = torch.randn(9, hidden, generator=torch.Generator().manual_seed(9))
    ids = torch.tensor([[e % experts, (e + 1) % experts] for e in range(9)])
    wts = torch.rand(9, 2, generator=torch.Generator().manual_seed(1))
    plain, repacked = op(False)(h, ids, wts), op(True)(h, ids, wts)
    torch.testing.assert_close(repacked, plain, rtol=1e-4, atol=1e-4 * plain.abs().max().item())
    assert torch.equal(op(True)(h[4:5], ids[4:5], wts[4:5])[0], repacked[4])


@pytest.mark.parametrize("t", [T.Q4_1, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_prompt_rows_take_the_same_path_whatever_the_batch(ops, t: T) -> None:
    """decode_rows chooses the path by the rows, not by M: prompt rows are the bf16 panels' whether 3 or 40
    of them come (a prefix-cache hit leaves a few), so each row gets the same bits in either batch; a step of
    decodes alone under 16 rows keeps the integer dot."""
    o, k = 100, 512
    raw = torch.from_numpy(random_blocks(t, o, k))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    whole = ops.linear_ggml(x, [raw], [int(t)], [o], None, o, 0)
    for lo, hi in [(37, 40), (0, 1), (20, 31)]:
        assert torch.equal(ops.linear_ggml(x[lo:hi], [raw], [int(t)], [o], None, o, 0), whole[lo:hi])
    decodes = ops.linear_ggml(x[:3], [raw], [int(t)], [o], None, o, 3)
    assert torch.equal(decodes, ops.linear_ggml(x[:3], [raw], [int(t)], [o], None, o))  # M < 16: the dot
    assert not torch.equal(decodes, whole[:3])
