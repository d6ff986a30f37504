"""Which rows each tensor-parallel rank keeps: the Gated DeltaNet's heads and the divisibility checks (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import ConfigError
from pagedllm.distributed import check_divisible
from pagedllm.model_executor.models.config import ModelConfig
from pagedllm.model_executor.models.gemma4 import Gemma4Config
from pagedllm.model_executor.models.weight_names import piece_rows


def _delta_net(hk: int, hv: int, tiled: bool) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=8, linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=4,
                       linear_value_head_dim=2, linear_value_heads_tiled=tiled)


def _reads(j: int, hk: int, hv: int, tiled: bool) -> int:
    """The key head value head j reads: tiled (llama.cpp's files) j % Hk, grouped (HF's) j // (Hv / Hk)."""
    return j % hk if tiled else j // (hv // hk)


@pytest.mark.parametrize("tiled", [False, True])
def test_each_rank_keeps_the_key_heads_its_value_heads_read_and_reads_them_as_the_layer_did(tiled):
    """Every (Hk, Hv, world) up to 16 heads: a rank's value heads are an even span; the key span it keeps holds
    every key head they read, and the rank's local heads, tiled or grouped as the layer is, map onto exactly those;
    a cut that cannot be made so is refused (None)."""
    cut = 0
    for hk in (1, 2, 4, 8, 16):
        for r in (1, 2, 4):
            hv = hk * r
            for world in (1, 2, 4, 8):
                cfg = _delta_net(hk, hv, tiled)
                spans = [cfg.linear_key_span(world, rank) for rank in range(world)]
                if hv % world:
                    assert spans == [None] * world
                    continue
                m = hv // world
                ok = all(s is not None for s in spans)
                if not ok:
                    assert all(s is None for s in spans)
                    continue
                cut += 1
                for rank, (lo, hi) in enumerate(spans):
                    local_hk = hi - lo
                    for jl in range(m):
                        local = _reads(jl, local_hk, m, tiled)
                        assert lo + local == _reads(rank * m + jl, hk, hv, tiled), (hk, hv, world, rank, jl)
    assert cut >= 40  # most shapes cut (those that do not are refused at startup)


def test_qwen35_9b_at_tp2_keeps_all_16_key_heads_of_its_file_and_half_of_hf():
    """Qwen3.5-9B's 16 key heads for 32 value heads: its GGUF (tiled) needs every key head on each rank; HF's
    grouped order splits them."""
    assert _delta_net(16, 32, True).linear_key_span(2, 1) == (0, 16)
    assert _delta_net(16, 32, False).linear_key_span(2, 1) == (8, 16)
    assert _delta_net(16, 32, True).linear_key_span(4, 3) == (8, 16)


def test_stacked_rows_cut_each_piece_by_its_own_rule():
    """in_proj_qkv stacks q and k channels (Hk Dk each) and v (Hv Dv): rank 1 of 2 of a grouped 2/4-head layer."""
    cfg = _delta_net(2, 4, False)
    pieces = piece_rows(("lk", "lk", "lv"), cfg, 2, 1)
    assert [(n, keep.tolist()) for n, keep in pieces] == [(8, [4, 5, 6, 7]), (8, [4, 5, 6, 7]), (8, [4, 5, 6, 7])]
    tiled = piece_rows(("lk", "lk", "lv"), _delta_net(2, 4, True), 2, 1)
    assert [keep.tolist() for _, keep in tiled] == [list(range(8)), list(range(8)), [4, 5, 6, 7]]
    assert np.array_equal(piece_rows(("lh",), cfg, 2, 0)[0][1], [0, 1])


def test_divisibility_names_what_does_not_cut():
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        check_divisible(_delta_net(1, 3, False), 2)
    with pytest.raises(ConfigError, match=r"linear-attention heads \(2 key, 6 value\)"):
        check_divisible(_delta_net(2, 6, True), 2)  # tiled: a rank's 3 value heads read keys 0, 1, 0
    cfg = Gemma4Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8, layer_shapes=((8, 2), (16, 1)))
    with pytest.raises(ConfigError, match=r"a layer's num_key_value_heads \(1\)"):
        check_divisible(cfg, 2)
    check_divisible(cfg, 1)
