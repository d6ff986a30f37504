"""Engine behaviour on a tiny random Llama: memory accounting, sampling options, bad input."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, InvalidRequestError, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def rand_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 320) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]} for _ in range(n)]


def test_64_mixed_requests_free_everything_and_waste_under_one_block(llama_dir):
    engine = LLMEngine(EngineConfig(model=llama_dir, block_size=8, num_kv_blocks=400,
                                    enable_prefix_caching=False, max_num_batched_tokens=256))
    rng = random.Random(3)
    want = {str(i): rng.randint(1, 60) for i in range(64)}
    for i, p in enumerate(rand_prompts(64, 1, 120, seed=3)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=want[str(i)], ignore_eos=True))
    bm, sched = engine.block_manager, engine.scheduler
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        live = {r.request_id: r.num_computed_tokens for r in sched.running}
        need = sum(bm.blocks_needed(n) for n in live.values())
        assert bm.num_used_blocks == need  # on-demand: no block beyond the live tokens
        assert bm.num_used_blocks * 8 - sum(live.values()) < 8 * max(1, len(live))
    assert len(finished) == 64
    assert {k: len(o.outputs[0].token_ids) for k, o in finished.items()} == want
    assert {o.outputs[0].finish_reason for o in finished.values()} == {"length"}
    assert bm.num_free_blocks == bm.num_blocks
    st = engine.stats()
    assert st.kv_blocks_used == 0 and st.num_running == st.num_waiting == 0
    assert st.peak_num_running > 8  # continuous batching really batched


def test_preemption_and_prefix_caching_do_not_change_greedy_outputs(llama_dir):
    prompts = rand_prompts(16, 5, 70, seed=5)
    shared = [{"prompt_token_ids": list(range(40)) + p["prompt_token_ids"]} for p in prompts[:8]]
    ref = LLM(model=llama_dir, enable_prefix_caching=False).generate(prompts + shared, GREEDY)
    tight = LLM(model=llama_dir, block_size=4, num_kv_blocks=60, max_num_batched_tokens=64)
    outs = tight.generate(prompts + shared, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    st = tight.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert st.kv_blocks_used == 0


def test_reserve_mode_matches_and_never_preempts(llama_dir):
    prompts = rand_prompts(12, 5, 40, seed=8)
    ref = LLM(model=llama_dir).generate(prompts, GREEDY)
    llm = LLM(model=llama_dir, block_size=4, num_kv_blocks=40, preemption_mode="reserve")
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.stats().num_preemptions == 0


def test_n_samples_fork_share_prompt_and_greedy_children_agree(llama_dir):
    llm = LLM(model=llama_dir, block_size=4)
    p = {"prompt_token_ids": list(range(30))}
    single = llm.generate(p, GREEDY)[0].outputs[0].token_ids
    outs = llm.generate(p, SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert [c.index for c in outs.outputs] == [0, 1, 2]
    assert all(c.token_ids == single for c in outs.outputs)  # CoW kept each child's KV right
    sampled = llm.generate(p, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    assert llm.stats().kv_blocks_used == 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama_dir):
    llm = LLM(model=llama_dir)
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=42, max_tokens=16, ignore_eos=True)
    p = {"prompt_token_ids": [5, 6, 7, 8]}
    alone = llm.generate(p, sp)[0].outputs[0].token_ids
    others = rand_prompts(6, 3, 30, seed=9)
    mixed = llm.generate([*others, p], [SamplingParams(temperature=1.0, max_tokens=20)] * 6 + [sp])
    assert mixed[-1].outputs[0].token_ids == alone


def test_stop_token_ids_min_tokens_max_tokens(llama_dir):
    llm = LLM(model=llama_dir)
    p = {"prompt_token_ids": [1, 2, 3, 4]}
    free = llm.generate(p, GREEDY)[0].outputs[0].token_ids
    stop_tok = free[3]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                         stop_token_ids=[stop_tok]))[0].outputs[0]
    first = free.index(stop_tok)
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=first + 2,
                                         stop_token_ids=[stop_tok]))[0].outputs[0]
    assert len(out.token_ids) >= first + 2 and stop_tok not in out.token_ids[:first + 2]


def test_logit_bias_and_allowed_token_ids(llama_dir):
    llm = LLM(model=llama_dir)
    p = {"prompt_token_ids": [1, 2, 3, 4]}
    kw = dict(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate(p, SamplingParams(**kw))[0].outputs[0].token_ids
    forced = llm.generate(p, SamplingParams(**kw, logit_bias={77: 100}))[0].outputs[0].token_ids
    assert forced == [77] * 12
    banned = llm.generate(p, SamplingParams(**kw, logit_bias={free[0]: -100}))[0].outputs[0].token_ids
    assert banned[0] != free[0]
    allowed = [5, 9, 200, 201]
    out = llm.generate(p, SamplingParams(**kw, allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert set(out) <= set(allowed)
    sampled = llm.generate(p, SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=1,
                                             allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert set(sampled) <= set(allowed) and len(set(sampled)) > 1
    assert llm.generate(p, SamplingParams(**kw, logit_bias={}))[0].outputs[0].token_ids == free
    with pytest.raises(InvalidRequestError, match="logit_bias: token id 320"):
        llm.generate(p, SamplingParams(**kw, logit_bias={320: 1}))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.generate(p, SamplingParams(**kw, allowed_token_ids=[1, 9999]))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101})


def test_bad_words_are_never_generated(chat_model_dir):
    llm = LLM(model=chat_model_dir)
    tok = llm.get_tokenizer()
    kw = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = llm.generate("We the People", SamplingParams(**kw))[0].outputs[0].token_ids
    j = next(i for i in range(len(free) - 1) if tok.decode([free[i]]).strip() and tok.decode(free[i:i + 2]).strip())
    one = tok.decode([free[j]]).strip()
    spellings = {t for w in (one, " " + one) for t in tok.encode(w, add_special_tokens=False)[:1]
                 if len(tok.encode(w, add_special_tokens=False)) == 1}
    out = llm.generate("We the People", SamplingParams(**kw, bad_words=[one]))[0].outputs[0].token_ids
    assert spellings and not spellings & set(out) and out != free
    pair = free[j:j + 2]  # a two-token word: its last token is banned only right after its first
    word = tok.decode(pair)
    if tok.encode(word.strip(), add_special_tokens=False) == pair or tok.encode(" " + word.strip(),
                                                                                add_special_tokens=False) == pair:
        out = llm.generate("We the People", SamplingParams(**kw, bad_words=[word]))[0].outputs[0].token_ids
        assert all(out[i:i + 2] != pair for i in range(len(out) - 1))
        assert out[:j + 1] == free[:j + 1]  # nothing before the word's last token changes
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])


def test_logprobs_are_top_k_of_each_sampled_token(llama_dir):
    llm = LLM(model=llama_dir)
    out = llm.generate({"prompt_token_ids": [9, 8, 7]}, SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                                        ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lps in zip(out.token_ids, out.logprobs):
        assert tok in lps and lps[tok].rank == 1  # greedy picks the top token
        assert len(lps) == 3
        assert max(lps.values(), key=lambda x: x.logprob) is lps[tok]
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))


def test_bad_input_is_refused_and_others_complete(llama_dir):
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=16, block_size=16))  # pool: 256 tokens
    engine.add_request("good", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    bad = [
        ({"prompt_token_ids": []}, GREEDY, "empty"),
        ({"prompt_token_ids": [1, 99999]}, GREEDY, "outside the vocabulary"),
        ({"prompt_token_ids": [1, -1]}, GREEDY, "outside the vocabulary"),
        ({"prompt_token_ids": [1] * 300}, GREEDY, "max_model_len"),
        ({"prompt_token_ids": [1] * 250}, SamplingParams(max_tokens=10), "exceeds max_model_len"),
        ("text", GREEDY, "no tokenizer"),
    ]
    for prompt, sp, msg in bad:
        with pytest.raises(InvalidRequestError, match=msg):
            engine.add_request(None, prompt, sp)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", {"prompt_token_ids": [1]}, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"] and len(outs[0].outputs[0].token_ids) == 12
    assert engine.block_manager.num_free_blocks == 16


def test_abort_frees_blocks_and_reports(llama_dir):
    engine = LLMEngine(EngineConfig(model=llama_dir, block_size=4))
    engine.add_request("a", {"prompt_token_ids": list(range(50))}, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": list(range(9))}, SamplingParams(n=2, max_tokens=100))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    out = engine.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    out = engine.abort("b")
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.abort("nope") is None


def test_kv_budget_arithmetic(llama_dir):
    e = LLMEngine(EngineConfig(model=llama_dir, kv_cache_memory="1MiB", block_size=16, dtype="float32"))
    # 2 layers x 2 (K,V) x 2 kv heads x 16 head_dim x 4 bytes = 512 bytes/token
    assert e.kv_bytes_per_token == 512
    assert e.block_manager.num_blocks == 2**20 // (512 * 16)
    assert e.max_model_len == min(1024, e.block_manager.num_blocks * 16)


def test_kv_snapshot_matches_the_engine_between_steps(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=80, block_size=4, max_model_len=256)
    e = llm.engine
    prefix = list(range(1, 13))  # 3 full blocks every request shares
    for i in range(3):
        e.add_request(f"r{i}", {"prompt_token_ids": prefix + [20 + i]}, SamplingParams(max_tokens=6, n=2, ignore_eos=True))
    for _ in range(3):
        e.step()
    snap = llm.kv_snapshot()
    st, pool = snap["stats"], snap["pool"]
    assert st == e.stats().to_dict()  # the snapshot's shortcut counts agree with a full stats()
    assert pool["state"].count(0) + pool["state"].count(1) == pool["num_blocks"] - st["kv_blocks_used"]
    ids = [r["id"] for r in snap["requests"]]
    assert sorted(ids) == sorted(r.request_id for r in e.scheduler.running)
    for bid in e.block_manager.table("r0#0")[:3]:  # the shared prefix: held by all 6 sequences
        holders = [ids[r] for blk, r in zip(pool["shared_blocks"], pool["shared_holders"]) if blk == bid]
        assert sorted(holders) == sorted(ids) and pool["ref"][bid] == 6
    assert snap["static"]["reserved_tokens"] == 6 * 256
    assert snap["static"]["live_tokens"] == sum(r.num_computed_tokens for r in e.scheduler.running)
    while e.has_unfinished_requests():
        e.step()
    idle = llm.kv_snapshot()
    assert idle["requests"] == [] and idle["pool"]["state"].count(2) == idle["pool"]["state"].count(3) == 0
    assert idle["pool"]["cached_free"] == idle["stats"]["kv_blocks_cached_free"] > 0


def test_steps_from_another_thread_are_warned_of_once(llama_dir, caplog):
    """A step in another thread than the one before it gets one warning (OpenMP keeps a team per thread that runs
    the kernels; more team threads than cores put the idle workers to sleep between kernel calls)."""
    import threading

    engine = LLM(llama_dir, num_kv_blocks=32, block_size=16).engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, params)
    with caplog.at_level("WARNING", logger="pagedllm"):
        engine.step()
        engine.step()
        assert "another thread" not in caplog.text
        for _ in range(2):
            t = threading.Thread(target=engine.step)
            t.start()
            t.join()
    assert caplog.text.count("LLMEngine.step ran in another thread") == 1
