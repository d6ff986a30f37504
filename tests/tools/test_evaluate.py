"""Teacher-forced scoring (tools/evaluate.py) through the paged cache and, for linear-attention models, a state slot."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.tools.evaluate import chunk_logits


@pytest.mark.parametrize("arch", ["llama", "qwen3.5"])
def test_every_positions_logits_are_hfs_across_chunks(tiny_models, arch) -> None:
    """Chunks of 7 over 40 tokens: each position's logits within 1e-4 of HF's one forward, for a model whose layers
    keep KV and one whose linear-attention layers carry a state from chunk to chunk; the slot is given back."""
    import torch

    folder, hf = tiny_models[arch]
    llm = LLM(model=folder, dtype="float32", kv_cache_dtype="float32", num_kv_blocks=64)
    ids = [(i * 37 + i * i * 11) % hf.config.vocab_size for i in range(40)]
    ours = torch.cat([lg for _, lg in chunk_logits(llm.engine, ids, chunk=7)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max() < 1e-4
    states = llm.engine.scheduler.state_slots
    assert states is None or states.num_free == states.num_slots
