"""Speculative decoding: proposals, rollback, and outputs identical to (greedy) or distributed as
(sampled) decoding without it."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request
from pagedllm.errors import ConfigError
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.ngram import NgramProposer, SpeculativeConfig, record_acceptance, should_propose

pytestmark = pytest.mark.slow  # engines end to end: the full suite, not the fast tier

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}


def _req(prompt: list[int], out: list[int] = ()) -> Request:
    r = Request("r", list(prompt), SamplingParams(max_tokens=64))
    r.output_token_ids = list(out)
    return r


def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    r = _req([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4], [5, 6, 7])
    assert p.propose(r, 2) == [3, 4]  # "5 6 7" last seen before index 10: followed by 3, 4
    r.output_token_ids += [3]
    assert p.propose(r, 4) == [4, 5, 6, 7]  # now "6 7 3" matches: what followed it, incrementally indexed
    assert p.propose(_req([1, 2, 3, 4]), 3) == []  # no earlier occurrence of any suffix
    # byte-level false matches across token boundaries are skipped: 256 = 00 01 00 00, 1 = 01 00 00 00
    assert p.propose(_req([256, 0, 9, 1]), 2) == []
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="unknown field 'k'"):
        SpeculativeConfig.parse({"k": 3})
    with pytest.raises(ConfigError, match="needs a model"):
        SpeculativeConfig(method="draft_model")


def test_adaptive_gate_pauses_requests_whose_proposals_fail():
    cfg = SpeculativeConfig(window=4, min_acceptance=0.5, pause_steps=3)
    r = _req([1])
    for _ in range(4):
        assert should_propose(r)
        record_acceptance(r, 4, 0, cfg)
    assert [should_propose(r) for _ in range(4)] == [False, False, False, True]


def test_truncate_frees_rolled_back_blocks_and_never_caches_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    toks = list(range(6))
    bm.allocate_slots("a", toks, 0, 6)  # blocks 0, 1 (0 full: hashed)
    bm.allocate_slots("a", toks, 6, 1 + 6)  # a decode with 6 proposals: slots up to 13 -> blocks 2, 3
    assert bm.table("a") == [0, 1, 2, 3] and bm.blocks[2].block_hash is None
    bm.truncate("a", 8)  # 2 proposals accepted: 8 slots hold KV
    assert bm.table("a") == [0, 1] and list(bm.free_queue)[:2] == [2, 3]
    assert bm.blocks[1].block_hash is None  # block 1 only fills when the verified token 8 arrives
    bm.allocate_slots("a", toks + [6, 7, 8], 8, 1)
    assert bm.blocks[1].block_hash is not None and len(bm.cached) == 2


def _outputs(llm: LLM, prompts: list, params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def _repetitive_prompts(n: int, vocab: int = 320, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, vocab) for _ in range(rng.randint(5, 20))]
        out.append({"prompt_token_ids": base * 3 + base[:rng.randint(1, 4)]})
    return out


@pytest.mark.parametrize("options", [
    dict(dtype="float32"),  # one batch, all at once
    dict(dtype="float32", max_num_seqs=1),  # one at a time
    dict(dtype="float32", max_num_batched_tokens=16),  # chunked prefill next to speculating decodes
    dict(dtype="float32", num_kv_blocks=24, block_size=4),  # preemption (recompute) mid-speculation
    dict(),  # the CPU's auto dtype (bf16 with AVX512-BF16)
    dict(kv_cache_dtype="fp8_e4m3"),
])
def test_greedy_outputs_are_token_identical_with_ngram(llama_dir, options):
    prompts = _repetitive_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = _outputs(LLM(llama_dir, **options), prompts, params)
    spec = LLM(llama_dir, speculative_config=NGRAM, **options)
    assert _outputs(spec, prompts, params) == base
    st = spec.stats()
    assert st.spec_num_drafts > 0 and 0 < st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    if "num_kv_blocks" in options:
        assert st.num_preemptions > 0


def test_greedy_identical_with_prefix_hits_n2_stop_strings_and_logprobs(chat_model_dir):
    prompts = ["the cat sat on the mat, the cat sat on the mat, the cat", "the cat sat on the mat. And then"]
    params = SamplingParams(temperature=0, max_tokens=30, n=2, logprobs=2, stop=["mat and"])
    plain = LLM(chat_model_dir, block_size=4)
    base = [plain.generate(p, params)[0] for p in prompts]  # one after the other: the second hits the first's prefix
    llm = LLM(chat_model_dir, block_size=4, speculative_config=NGRAM)
    spec = [llm.generate(p, params)[0] for p in prompts]
    for a, b in zip(base, spec):
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                             y.stop_reason)
            assert [sorted(d) for d in x.logprobs] == [sorted(d) for d in y.logprobs]
            assert all(abs(d[t].logprob - e[t].logprob) < 1e-4 for d, e in zip(x.logprobs, y.logprobs) for t in d)
    assert llm.stats().spec_num_accepted_tokens > 0
    assert spec[1].num_cached_tokens > 0  # the second prompt hit the first one's prefix


def test_structured_outputs_cut_proposals_and_stay_valid(chat_model_dir):
    import re

    pattern = r"(ab|abc){6}[0-9]{4}"
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": pattern})
    prompts = ["ab abc ab abc ab abc ab abc", "abcabcabcabc"]
    base = LLM(chat_model_dir).generate(prompts, params)
    spec = LLM(chat_model_dir, speculative_config=NGRAM).generate(prompts, params)
    for a, b in zip(base, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert re.fullmatch(pattern, b.outputs[0].text)


def _p_value(stat: float, k: int) -> float:
    """Upper tail of chi-square with k degrees of freedom (Wilson-Hilferty normal approximation)."""
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _chi_square_p(counts: list[int], probs: list[float]) -> float:
    """Pearson's goodness of fit; cells expecting < 5 pooled into one."""
    n = sum(counts)
    cells = [(c, n * p) for c, p in zip(counts, probs) if n * p >= 5]
    rest_c, rest_e = n - sum(c for c, _ in cells), n - sum(e for _, e in cells)
    if rest_e >= 5:
        cells.append((rest_c, rest_e))
    return _p_value(sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1)


def _two_sample_p(a: list[int], b: list[int]) -> float:
    """Pearson's test that two count vectors come from one distribution; sparse cells pooled."""
    na, nb = sum(a), sum(b)
    cells, rest = [], [0, 0]
    for x, y in zip(a, b):
        if (x + y) * min(na, nb) / (na + nb) >= 5:
            cells.append((x, y))
        else:
            rest[0] += x
            rest[1] += y
    if sum(rest) * min(na, nb) / (na + nb) >= 5:
        cells.append(tuple(rest))
    stat = 0.0
    for x, y in cells:
        ea, eb = na * (x + y) / (na + nb), nb * (x + y) / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return _p_value(stat, len(cells) - 1)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_probs):
    """The first and second emitted tokens, over 4,000 seeds, against the target's distributions.
    An n-gram proposal is a fixed token (q a point mass); a draft model's is drawn from its q."""
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(3, vocab) * 1.5  # rows for: after the last token, after draft 1, after draft 2
    q = torch.softmax(torch.randn(2, vocab), -1) if with_draft_probs else None
    fixed = [int(logits[0].argmax()), 3]
    draw = torch.Generator().manual_seed(1)
    firsts, seconds = [0] * vocab, [0] * vocab
    for seed in range(4000):
        s = Sampler(seed)
        r = Request(str(seed), [1], SamplingParams(temperature=1.0, seed=seed, max_tokens=8))
        drafts = fixed if q is None else [int(torch.multinomial(q[i], 1, generator=draw)) for i in range(2)]
        out, _ = s.verify(logits, r, drafts, set(), q)
        firsts[out[0].token_id] += 1
        if out[0].token_id == drafts[0]:
            seconds[out[1].token_id] += 1
    p0 = torch.softmax(logits[0], -1).tolist()
    p1 = torch.softmax(logits[1], -1).tolist()  # given the first draft was emitted, the next is drawn from row 1
    assert _chi_square_p(firsts, p0) > 1e-3, (firsts, p0)
    assert _chi_square_p(seconds, p1) > 1e-3, (seconds, p1)
    assert sum(seconds) > 500  # the first draft was accepted often enough to test the second position


def test_sampled_engine_outputs_follow_the_same_distribution(llama_dir):
    """Second-token frequencies over 1,500 seeds, with and without n-gram speculation, against each
    other: a two-sample chi-square. The prompt holds every token once, so whatever the first sampled
    token is, lookup proposes the one that followed it."""
    prompt = {"prompt_token_ids": list(range(3, 320)) + [7, 8]}

    def second_tokens(llm: LLM) -> list[int]:
        outs = llm.generate([prompt] * 1500, [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True)
                                              for s in range(1500)])
        return [o.outputs[0].token_ids[1] for o in outs]

    plain = second_tokens(LLM(llama_dir, max_num_seqs=256))
    llm = LLM(llama_dir, max_num_seqs=256, speculative_config={**NGRAM, "num_speculative_tokens": 2})
    spec = second_tokens(llm)
    assert llm.stats().spec_num_drafts > 500
    vals = sorted(set(plain) | set(spec))
    a, b = [plain.count(v) for v in vals], [spec.count(v) for v in vals]
    assert _two_sample_p(a, b) > 1e-3, (vals, a, b)


@pytest.mark.parametrize("draft,options", [
    ("self", dict()),  # the target as its own draft: every proposal should be accepted
    ("self", dict(num_kv_blocks=24, block_size=4)),  # preemption: both pools roll back together
    ("qwen2", dict(max_num_batched_tokens=16)),  # a different model (mostly rejected), next to chunked prefill
])
def test_greedy_outputs_are_token_identical_with_a_draft_model(tiny_models, draft, options):
    target = tiny_models["llama"][0]
    cfg = {"method": "draft_model", "model": target if draft == "self" else tiny_models[draft][0],
           "num_speculative_tokens": 3, "disable_by_batch_size": None}
    prompts = _repetitive_prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = _outputs(LLM(target, **options), prompts, params)
    llm = LLM(target, speculative_config=cfg, **options)
    assert _outputs(llm, prompts, params) == base
    st = llm.stats()
    assert st.spec_num_drafts > 0
    if draft == "self" and "num_kv_blocks" not in options:
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens  # identical models agree on every token
    if "num_kv_blocks" in options:
        assert st.num_preemptions > 0


def test_draft_model_sampling(tiny_models):
    target = tiny_models["llama"][0]
    llm = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3,
                                          "disable_by_batch_size": None})
    outs = llm.generate(_repetitive_prompts(4, seed=5), SamplingParams(temperature=0.9, seed=1, max_tokens=24,
                                                                       ignore_eos=True, n=2))
    assert all(len(c.token_ids) == 24 for o in outs for c in o.outputs)
    assert llm.stats().spec_num_accepted_tokens > 0


def test_draft_model_with_a_grammar_and_a_foreign_vocabulary(chat_model_dir):
    import re

    from pagedllm.model_executor.model_loader import default_model_path

    pattern = r"(ab|cd){8}[0-9]{3}"
    cfg = {"method": "draft_model", "model": chat_model_dir, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": pattern})
    base = LLM(chat_model_dir).generate(["ab cd", "cdcd"], params)
    llm = LLM(chat_model_dir, speculative_config=cfg)
    spec = llm.generate(["ab cd", "cdcd"], params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in spec)
    assert llm.stats().spec_num_accepted_tokens == llm.stats().spec_num_draft_tokens > 0  # masked like the target
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(chat_model_dir, speculative_config={"method": "draft_model", "model": str(default_model_path())})


@pytest.mark.slow
def test_server_flag_and_prometheus_counters(chat_model_dir):
    import httpx
    from helpers import Server

    srv = Server(chat_model_dir, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                 '"prompt_lookup_min": 1}')
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": "the cat sat on the mat, the cat sat on the mat, the cat sat on the", "max_tokens": 24,
            "temperature": 0})
        assert r.status_code == 200
        assert srv.metric("spec_decode_num_drafts_total") > 0
        assert srv.metric("spec_decode_num_draft_tokens_total") >= srv.metric("spec_decode_num_accepted_tokens_total") > 0
        assert srv.metric("spec_decode_num_accepted_tokens_per_pos_total", '{position="0"}') > 0
    finally:
        assert srv.stop() == 0
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pagedllm", "generate", "hi", "--model", chat_model_dir,
                        "--speculative-config", '{"method": "medusa"}'], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "medusa" in r.stderr, r.stderr  # a bad config is refused with the reason
