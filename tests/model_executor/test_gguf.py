"""GGUF files run in their own formats (loader.load_gguf, weight_formats.GGMLWeight): every supported
type against the same file dequantized to fp32, weights used in place, mixed and unsupported types."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("gguf")

from pagedllm import LLM, SamplingParams
from pagedllm.bench.random_gguf import SHAPES, write_random_gguf
from pagedllm.platforms.cpu import load_ops
from pagedllm.tools.evaluate import compare_to_reference

pytestmark = pytest.mark.skipif(load_ops() is None, reason="C++ kernels unavailable")
IDS = [(i * 37 + i * i * 11) % 320 for i in range(300)]
STD = 0.08  # larger than real models' 0.02 so the tiny random model's predictions are not near-uniform


def _pair(path, **kw):
    ref = LLM(model=str(path), dtype="float32", quantization="none", num_kv_blocks=64)
    native = LLM(model=str(path), dtype="float32", num_kv_blocks=64, **kw)
    return ref, native


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                   "Q4_K", "Q5_K", "Q6_K"])
def test_each_format_runs_in_place_and_tracks_its_dequantized_reference(tmp_path, qtype: str) -> None:
    path = write_random_gguf(tmp_path / f"{qtype}.gguf", SHAPES["tiny"], qtype, seed=1, std=STD)
    ref, native = _pair(path)
    model = native.engine.runner.model
    expect = {"F32": "f32", "F16": "f32", "BF16": "f32"}.get(qtype, qtype.lower())
    assert model.weight_format == expect
    r = compare_to_reference(ref.engine, native.engine, IDS, chunk=64)
    if expect == "f32":  # dense formats: the same fp32 weights, the same kernels
        assert r["mean_kl"] == 0 and r["top1_agreement"] == 1
    else:  # the only difference is int8 activations in decode-sized batches (ggml's vec_dot_type)
        assert abs(r["perplexity"] / r["perplexity_ref"] - 1) < 0.01, r
        assert r["mean_kl"] < 1e-3 and r["top1_agreement"] > 0.93, r  # near-ties of a random model


def test_a_random_qwen35_file_runs_its_delta_net_layers_in_q8_0_and_tracks_the_dequantized_reference(tmp_path) -> None:
    """`bench random-gguf --shape tiny-qwen3.5`: Gated DeltaNet layers in llama.cpp's ssm_* tensors (their fused
    in-projection's four parts in Q8_0 blocks), a gated full-attention layer; the file's layer kinds and state
    read back, and through chunks of 64 (the state carried) the blocks track the same file dequantized."""
    path = write_random_gguf(tmp_path / "q35.gguf", SHAPES["tiny-qwen3.5"], "Q8_0", std=STD)
    ref, native = _pair(path)
    model = native.engine.runner.model
    assert model.cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert model.weight_format == "q8_0" and model.cfg.linear_value_heads_tiled
    r = compare_to_reference(ref.engine, native.engine, IDS, chunk=64)
    assert r["mean_kl"] < 1e-3 and r["top1_agreement"] > 0.93, r


def test_quantized_weights_are_the_files_pages_not_a_copy(tmp_path) -> None:
    """Q5_K / Q5_0 / Q5_1 run on the mapped file itself; Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K are repacked once
    at load where the CPU has the 16-row-group kernel (Q4_0 / Q4_1 / Q8_0 the same bytes per weight),
    and then their file pages are dropped."""
    path = write_random_gguf(tmp_path / "q5k.gguf", SHAPES["tiny"], "Q5_K", std=STD)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    mapped = model.gguf.reader.data
    lo, hi = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    in_place = [lin.packed._weights[0].data_ptr() for lay in model.layers for lin in (lay.o_proj, lay.down_proj)]
    in_place.append(model.embed_packed._weights[0].data_ptr())
    assert all(lo <= p < hi for p in in_place)
    # q and k rows are reordered (llama.cpp interleaves the rotary halves), so they are copies
    assert not lo <= model.layers[0].qkv_proj.packed._weights[0].data_ptr() < hi
    assert model.linear_weight_bytes() == sum(t.n_bytes for t in model.gguf.reader.tensors if "norm" not in t.name)
    assert llm.generate([{"prompt_token_ids": IDS[:20]}], SamplingParams(max_tokens=4, temperature=0))[0].outputs

    path = write_random_gguf(tmp_path / "q4.gguf", SHAPES["tiny"], "Q4_0", std=STD)
    model = LLM(model=str(path), dtype="float32", num_kv_blocks=64).engine.runner.model
    ops = load_ops()
    assert model.layers[0].o_proj.packed.repacked == [bool(ops.ggml_repacks(2))]
    # the tiny shape's row counts are multiples of 16: repacking adds no padding
    assert model.linear_weight_bytes() == sum(t.n_bytes for t in model.gguf.reader.tensors if "norm" not in t.name)


def test_mixed_formats_of_a_q4_k_m_file(tmp_path) -> None:
    """Q4_K_M: Q6_K attn_v / ffn_down (and output) among Q4_K; a fused q/k/v mixes the two."""
    path = write_random_gguf(tmp_path / "q4km.gguf", SHAPES["tiny"], "Q4_K", std=STD, tie=False,
                             types={"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"})
    ref, native = _pair(path)
    model = native.engine.runner.model
    assert [f.name for f in model.layers[0].qkv_proj.packed.formats] == ["q4_k", "q4_k", "q6_k"]
    assert model.lm_head.packed.format_name == "q6_k"
    r = compare_to_reference(ref.engine, native.engine, IDS, chunk=64)
    assert r["mean_kl"] < 1e-3 and r["top1_agreement"] > 0.93, r  # near-ties of a random model


def test_a_type_without_a_kernel_is_dequantized_with_a_warning(tmp_path, caplog) -> None:
    path = write_random_gguf(tmp_path / "iq.gguf", SHAPES["tiny"], "Q4_0", std=STD, types={"ffn_down.weight": "IQ4_NL"})
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        ref, native = _pair(path)
    assert any("IQ4_NL" in r.message and "dequantized" in r.message for r in caplog.records)
    model = native.engine.runner.model
    assert model.layers[0].down_proj.packed.format_name == "f32"
    assert model.layers[0].o_proj.packed.format_name == "q4_0"
    r = compare_to_reference(ref.engine, native.engine, IDS, chunk=64)
    assert r["mean_kl"] < 1e-3, r


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_hf_checkpoint_quantized_at_load(tiny_models, quantization: str) -> None:
    path, hf = tiny_models["llama"]
    ref = LLM(model=path, dtype="float32", num_kv_blocks=64)
    q = LLM(model=path, dtype="float32", num_kv_blocks=64, quantization=quantization)
    model = q.engine.runner.model
    # the output projection stays at 8 bits when the layers get 4 (as llama.cpp's quantizer keeps output.weight)
    assert model.lm_head.packed.format_name == "q8_0"
    assert model.layers[0].qkv_proj.packed.format_name == quantization
    per_block = {"q8_0": 34, "q4_0": 18}[quantization]
    head = model.lm_head.in_features * model.lm_head.out_features
    assert model.linear_weight_bytes() == (model.matmul_params() - head) // 32 * per_block + head // 32 * 34
    r = compare_to_reference(ref.engine, q.engine, IDS, chunk=64)
    bound = {"q8_0": 5e-3, "q4_0": 0.3}[quantization]  # measured: 6e-4 and 0.12 (hidden 64: two blocks a row)
    assert r["mean_kl"] < bound, r


def test_linears_of_inputs_not_whole_blocks_stay_dense_when_quantized_at_load(tiny_models, caplog) -> None:
    """Qwen3.5's tiny conv-side projections take 16 inputs: q8_0 keeps those dense (llama.cpp's quantizer does
    the same) instead of failing the load, and quantizes the rest."""
    path, _ = tiny_models["qwen3.5"]
    with caplog.at_level("WARNING", logger="pagedllm"):
        q = LLM(model=path, dtype="float32", num_kv_blocks=64, quantization="q8_0")
    lins = q.engine.runner.model._linears()
    kept = [lin for lin in lins if lin.quantizable and lin.in_features % 32]
    assert kept and all(lin.packed.format_name == "f32" for lin in kept)
    assert any(lin.packed.format_name == "q8_0" for lin in lins)
    assert f"{len(kept)} linears kept dense" in caplog.text
    out = q.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_quantization_is_a_clear_error() -> None:
    from pagedllm.errors import ConfigError

    with pytest.raises(ConfigError, match="quantization"):
        LLM(quantization="q3_k")


def test_random_gguf_shapes_are_the_models() -> None:
    s = SHAPES["llama3-8b"]
    per_layer = 2 * s.hidden * s.hidden + 2 * s.hidden * s.kv_heads * (s.hidden // s.heads) + 3 * s.hidden * s.intermediate
    assert np.isclose(per_layer * s.layers / 1e9, 6.98, atol=0.01)  # Llama-3-8B's body, 7.0 B weights


def test_the_fast_reader_reads_what_gguf_reads(tmp_path) -> None:
    """gguf_file.open_gguf parses from a plain view of the map, arrays in one loop: the same fields (every value
    type, string and number arrays like a vocabulary's) and the same tensors as gguf's own reader."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from pagedllm.model_executor.model_loader.gguf_file import open_gguf

    path = tmp_path / "kinds.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_key_value("t.u32", 7, GGUFValueType.UINT32)
    w.add_key_value("t.f32", 0.5, GGUFValueType.FLOAT32)
    w.add_key_value("t.bool", True, GGUFValueType.BOOL)
    w.add_key_value("t.str", "héllo", GGUFValueType.STRING)
    w.add_key_value("t.tokens", [f"tok{i}" for i in range(300)] + ["", "ü"], GGUFValueType.ARRAY,
                    sub_type=GGUFValueType.STRING)
    w.add_key_value("t.ids", list(range(50)), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal(64).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref, fast = GGUFReader(str(path)), open_gguf(path)
    assert list(fast.fields) == list(ref.fields)
    assert all(fast.fields[k].contents() == ref.fields[k].contents() and fast.fields[k].types == ref.fields[k].types
               for k in ref.fields)
    assert fast.fields["t.tokens"].contents()[-1] == "ü"
    for k, f in ref.fields.items():  # down to the parts: arrays are read in one loop, not gguf's recursion
        assert fast.fields[k].data == f.data and len(fast.fields[k].parts) == len(f.parts), k
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(fast.fields[k].parts, f.parts)), k
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in fast.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in ref.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, ref.tensors))


@pytest.mark.parametrize("fraction", [0.5, 0.02])
def test_a_truncated_file_names_what_is_missing(tmp_path, fraction: float) -> None:
    from pagedllm.errors import ModelLoadError
    from pagedllm.model_executor.model_loader import default_model_path

    data = default_model_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * fraction)])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        LLM(str(cut))
    if fraction == 0.5:  # past the header: the tensor and its missing bytes
        assert "tensor 'blk." in str(e.value) and "missing" in str(e.value)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_moe_experts_run_in_their_blocks_and_track_the_dequantized_reference(tmp_path, qtype: str) -> None:
    """A qwen3moe file: each expert a slice of its 3-D tensor, run in place (or repacked) in the file's format;
    a decode step multiplies through the routed experts only."""
    path = write_random_gguf(tmp_path / "moe.gguf", SHAPES["tiny-moe"], qtype, seed=2, std=STD)
    ref, native = _pair(path)
    model = native.engine.runner.model
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.weight_format == f"{qtype.lower()}+f32"
    experts = model.layers[0].mlp.experts
    assert experts[3].down_proj.packed.format_name == qtype.lower()
    r = compare_to_reference(ref.engine, native.engine, IDS, chunk=64)
    # a dense model's 1e-3 KL bound is 4-6x too tight here: the kernels' rounding flips a few tokens' top-k picks
    # (Q4_0: 2 and 1 of 200 tokens in the two layers), and a flipped pick moves the output far more than rounding
    # does (measured: KL 0.0043 for Q4_0 and 0.0062 for Q4_K, perplexity within 0.5%)
    assert abs(r["perplexity"] / r["perplexity_ref"] - 1) < 0.01, r
    assert r["mean_kl"] < 0.015 and r["top1_agreement"] > 0.93, r
    s = SHAPES["tiny-moe"]
    per_expert = 3 * s.hidden * s.expert_intermediate
    idle = s.layers * per_expert * (s.experts - s.experts_used)
    assert model.matmul_params() == sum(lin.in_features * lin.out_features for lin in model._linears()) - idle


def test_the_moe_shape_is_qwen3_30b_a3b() -> None:
    s = SHAPES["qwen3-30b-a3b"]
    attn = 2 * s.hidden * s.heads * s.head_dim + 2 * s.hidden * s.kv_heads * s.head_dim
    experts = 3 * s.hidden * s.expert_intermediate
    assert np.isclose(s.layers * (attn + s.experts * experts) / 1e9, 29.9, atol=0.1)  # 30B weights in the body
    assert np.isclose(s.layers * (attn + s.experts_used * experts) / 1e9, 2.7, atol=0.1)  # ~3B of them active
