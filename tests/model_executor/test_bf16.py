"""bf16 weights: the C++ bf16 linear against its definition, and the bf16 engine against the fp32 one."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.platforms.cpu import auto_dtype, pad_bias, unpack_weight
from pagedllm.tools.evaluate import compare_to_reference


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17, 33, 64, 130])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (70, 33), (100, 576), (9, 2)])
def test_linear_bf16_is_a_bf16_matmul_with_fp32_sums(ops, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    packed = ops.pack_bf16(w)
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-out_features // 48), -(-in_features // 2), 48, 2)
    assert torch.equal(unpack_weight(packed, out_features)[:, :in_features], w.bfloat16())
    ref = x.bfloat16().double() @ w.bfloat16().double().T  # the products are exact; only the sum order differs
    torch.testing.assert_close(ops.linear_bf16(x, packed, None, out_features).double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.linear_bf16(x, packed, pad_bias(b), out_features).double(), ref + b.double(),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 7, 33, 130, 300])
@pytest.mark.parametrize("in_features, intermediate", [(64, 48), (576, 96), (33, 144)])
def test_gate_up_with_silu_in_one_pass_is_the_two_ops(ops, rows, in_features, intermediate):
    """The fused MLP kernel writes exactly what linear_bf16 then silu_and_mul write: the same panels, the same
    sums, the same silu; row blocks of 128 and their tails, with and without a bias."""
    g = torch.Generator().manual_seed(rows + in_features)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(2 * intermediate, in_features, generator=g) * 0.2
    packed, out = ops.pack_bf16(w), 2 * intermediate
    for b in (None, pad_bias(torch.randn(out, generator=g))):
        fused = ops.linear_bf16_silu_mul(x, packed, b, out)
        assert fused.shape == (rows, intermediate)
        assert torch.equal(fused, ops.silu_and_mul(ops.linear_bf16(x, packed, b, out)))


def test_gate_up_whose_halves_are_not_whole_panels(ops):
    """An intermediate size that is not a multiple of 48 cannot pair gate and up panels: the kernel refuses it
    and DensePanels takes the two-op path."""
    from pagedllm.model_executor.layers.weight_formats import DensePanels

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(2 * 40, 64, generator=g)
    with pytest.raises(RuntimeError, match="whole panels"):
        ops.linear_bf16_silu_mul(x, ops.pack_bf16(w), None, 80)
    dense = DensePanels(ops, w, None, torch.bfloat16)
    assert torch.equal(dense.matmul_silu_and_mul(x), ops.silu_and_mul(dense.matmul(x)))


def test_dense_gate_up_is_the_same_on_either_side_of_the_fused_row_count(ops):
    """DensePanels runs the fused kernel from FUSED_SILU_MIN_ROWS rows and the two ops under: a row's result
    must not depend on which (greedy tokens would change with the batch)."""
    from pagedllm.model_executor.layers.weight_formats import FUSED_SILU_MIN_ROWS, DensePanels

    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(2 * 96, 64, generator=g), torch.randn(FUSED_SILU_MIN_ROWS + 3, 64, generator=g)
    dense = DensePanels(ops, w, None, torch.bfloat16)
    together = dense.matmul_silu_and_mul(x)
    assert torch.equal(together, ops.linear_bf16_silu_mul(x, dense.data, None, 2 * 96))
    for i in range(x.shape[0]):
        assert torch.equal(dense.matmul_silu_and_mul(x[i:i + 1]), together[i:i + 1])


@pytest.mark.parametrize("in_features", [7, 16, 33, 576])
def test_linear_bf16_rounds_activations_as_torch_does(ops, in_features):
    """Through an identity weight y is the activations' bf16 exactly: round to nearest even on ties, values
    at bf16's extremes; vector body and scalar tail alike."""
    g = torch.Generator().manual_seed(in_features)
    x = torch.randn(5, in_features, generator=g) * torch.tensor([1e-30, 1.0, 3e4, 1e38, 1.0])[:, None]
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-126 * (1 + 2**-8)])  # halfway: even wins
    x[1, :min(4, in_features)] = ties[:min(4, in_features)]
    y = ops.linear_bf16(x, ops.pack_bf16(torch.eye(in_features)), None, in_features)
    assert torch.equal(y, x.bfloat16().float())


def test_dtype_auto_follows_the_cpu(ops):
    picked, why = auto_dtype()
    assert (picked == torch.bfloat16) == (ops.linear_bf16_isa in ("amx_bf16", "avx512_bf16")) and why


def test_bf16_engine_tracks_fp32_and_is_batch_invariant(llama_dir):
    ref = LLM(model=llama_dir, dtype="float32")
    bf = LLM(model=llama_dir, dtype="bfloat16")
    lin = bf.engine.runner.model.layers[0].qkv_proj
    assert lin.packed.format_name == "bf16" and lin.weight.numel() == 0
    assert bf.engine.runner.model.embed_tokens.weight.dtype == torch.float32  # activations stay fp32
    ids = [(i * 37 + i * i * 11) % 320 for i in range(600)]
    r = compare_to_reference(ref.engine, bf.engine, ids, chunk=128)
    # measured on this tiny random model: ppl within 0.1%, KL ~1e-4, top-1 ~99%
    assert abs(r["perplexity"] / r["perplexity_ref"] - 1) < 0.01 and r["mean_kl"] < 1e-2 and r["top1_agreement"] > 0.95
    prompts = [{"prompt_token_ids": ids[i:i + 20 + i]} for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in bf.generate(prompts, params)]
    alone = [bf.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    tight = LLM(model=llama_dir, dtype="bfloat16", block_size=4, num_kv_blocks=40, max_num_batched_tokens=32)
    squeezed = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert together == alone == squeezed  # chunking, batching and preemption change nothing in bf16 either
    assert tight.stats().num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512f", "avx2", "generic"])
def test_linear_bf16_fallback_isa_paths(request, tmp_path, isa):
    """The paths a CPU without AVX512-BF16 (avx512f), without AVX-512 (Zen 3: avx2) or without AVX2 (generic)
    compiles, built here by masking this CPU's flags, against the same reference."""
    if isa == "avx2":  # the whole library as Zen 3 builds it
        ops = request.getfixturevalue("ops_avx2")
        pack_bf16, linear_bf16, built_isa = ops.pack_bf16, ops.linear_bf16, ops.linear_bf16_isa
    else:  # a quick build of just this file with the ISA's flags masked
        from pathlib import Path

        from torch.utils.cpp_extension import load

        import pagedllm
        from pagedllm.platforms.cpu import cpu_isa_flags

        if isa == "avx512f" and "avx512f" not in cpu_isa_flags().split():
            pytest.skip("this CPU has no AVX-512")
        masked = ["-mno-avx512bf16", "-mno-amx-tile"] if isa == "avx512f" else ["-mno-avx2", "-mno-amx-tile"]
        csrc = Path(pagedllm.__file__).parent / "platforms" / "csrc"
        stub = tmp_path / "stub.cpp"
        stub.write_text('#include <torch/extension.h>\n#include "linear_bf16.h"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n'
                        '  m.def("pack_bf16", &pack_bf16); m.def("linear_bf16", &linear_bf16);\n'
                        '  m.def("isa", &linear_bf16_isa);\n}\n')
        mod = load(name=f"pagedllm_bf16_{isa}", sources=[str(csrc / "linear_bf16.cpp"), str(stub)],
                   extra_cflags=["-O2", "-march=native", *masked], extra_include_paths=[str(csrc)],
                   build_directory=str(tmp_path), verbose=False)
        pack_bf16, linear_bf16, built_isa = mod.pack_bf16, mod.linear_bf16, mod.isa()
    assert built_isa == isa
    g = torch.Generator().manual_seed(7)
    for rows, out_features, in_features in [(1, 70, 33), (9, 100, 576), (17, 48, 64)]:
        x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
        ref = x.bfloat16().double() @ w.bfloat16().double().T
        got = linear_bf16(x, pack_bf16(w), None, out_features).double()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
