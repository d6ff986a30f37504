"""The fused MoE layer: the C++ op over GGML experts against the layer's own per-expert loop, bit for bit, and a
token's output the same in any batch."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.bench.random_gguf import SHAPES, write_random_gguf


@pytest.fixture(scope="module", params=["Q4_0", "Q4_K", "gpt-oss"])
def moe_model(tmp_path_factory, request):
    """Qwen3-MoE's layers with Q4_0 or Q4_K experts, and gpt-oss's (biases, clamped SwiGLU) with MXFP4 ones."""
    where = tmp_path_factory.mktemp("moe") / "moe.gguf"
    if request.param == "gpt-oss":
        path = write_random_gguf(where, SHAPES["tiny-gpt-oss"], "Q8_0", seed=3, std=0.08,
                                 types={"_exps.weight": "MXFP4"})
    else:
        path = write_random_gguf(where, SHAPES["tiny-moe"], request.param, seed=3, std=0.08)
    model = LLM(model=str(path), dtype="float32", num_kv_blocks=16).engine.runner.model
    if model.ops is None:
        pytest.skip("C++ kernels disabled")
    return model


def _inputs(model, tokens: int, seed: int):
    moe = model.layers[1].mlp
    h = torch.randn(tokens, model.cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    weights, ids = moe.route(h, tokens)
    return moe, h, ids, weights


@pytest.mark.parametrize("tokens", [1, 2, 5, 9])
def test_the_op_is_the_per_expert_loop_on_decode_rows(moe_model, tokens: int) -> None:
    """Decode-sized batches: the loop's linears take the integer dot too, so both give the same bits."""
    moe, h, ids, weights = _inputs(moe_model, tokens, tokens)
    fused = moe_model.backend.moe_experts(moe, h, ids, weights, tokens)
    assert fused is not None  # every expert is a GGML weight: the op runs the layer
    assert torch.equal(fused, moe.run_experts(h, ids, weights, tokens, moe_model.backend))


def test_a_tokens_output_does_not_depend_on_its_batch(moe_model) -> None:
    moe, h, ids, weights = _inputs(moe_model, 60, 11)  # ~15 rows an expert: past linear_ggml's decode-size rule
    together = moe_model.backend.moe_experts(moe, h, ids, weights, 0)
    for t in (0, 17, 59):
        alone = moe_model.backend.moe_experts(moe, h[t:t + 1], ids[t:t + 1], weights[t:t + 1], 0)
        assert torch.equal(alone[0], together[t])
    ref = moe.run_experts(h, ids, weights, 0, moe_model.backend)  # the panel path for prompt rows: close, not equal
    assert (together - ref).abs().max() < 0.05 * ref.abs().max()


def test_only_the_picked_experts_are_read(moe_model) -> None:
    """An expert no token picked is never read: the op gives the same result with its weights gone."""
    moe, h, ids, weights = _inputs(moe_model, 2, 7)
    expected = moe_model.backend.moe_experts(moe, h, ids, weights, 2)
    args = moe_model.backend._moe[id(moe)][1]
    idle = sorted(set(range(moe.num_experts)) - set(ids.flatten().tolist()))
    assert idle
    gate_up, down, parts = list(args[0]), list(args[4]), args[3]
    for e in idle:  # empty tensors in place of the idle experts' blocks
        gate_up[e * parts:(e + 1) * parts] = [t[:0] for t in gate_up[e * parts:(e + 1) * parts]]
        down[e] = down[e][:0]
    assert torch.equal(moe_model.ops.MoeExperts(gate_up, *args[1:4], down, *args[5:])(h, ids, weights), expected)
