"""One request never poisons the engine: bad values are refused before they are queued, a request
that fails inside a step is aborted alone, and the engine serves the next call with no leaked block."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, InvalidRequestError, RequestFailedError, SamplingParams, limits

GOOD = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

BAD_VALUES = [
    dict(logprobs=10**6), dict(logprobs=21), dict(logprobs=-1), dict(seed=2**80), dict(seed=-(2**70)),
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=-1),
    dict(top_p=0), dict(top_p=float("nan")), dict(min_p=2), dict(presence_penalty=float("inf")),
    dict(frequency_penalty=3), dict(repetition_penalty=0), dict(repetition_penalty=float("nan")),
    dict(n=0), dict(n=10**6), dict(max_tokens=0), dict(min_tokens=5, max_tokens=2), dict(top_k=-2),
    dict(stop_token_ids=[10**12]), dict(stop_token_ids=[-1]), dict(allowed_token_ids=[]),
    dict(allowed_token_ids=[10**9]), dict(logit_bias={10**9: 1.0}), dict(logit_bias={1: float("nan")}),
    dict(logit_bias={"x": 1}), dict(bad_words=["w"] * (limits.MAX_BAD_WORDS + 1)), dict(bad_words=["\ud800"]),
    dict(stop=["x"] * (limits.MAX_STOP_STRINGS + 1)), dict(stop=["\ud800"]), dict(stop=5), dict(temperature="hot"),
    dict(structured_outputs={"choice": [str(i) for i in range(limits.MAX_CHOICES + 1)]}),
    dict(structured_outputs={"grammar": "root ::= root root"}),
]


@pytest.fixture(scope="module")
def llm(chat_model_dir):
    return LLM(chat_model_dir, num_kv_blocks=64, block_size=8)


def clean(llm: LLM) -> None:
    e = llm.engine
    assert (e.block_manager.num_used_blocks, len(e.scheduler.running), len(e.scheduler.waiting), len(e.groups)) \
        == (0, 0, 0, 0)


@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda d: next(iter(d)))
def test_a_bad_value_is_refused_and_the_next_generate_succeeds(llm, bad):
    with pytest.raises(InvalidRequestError):
        llm.generate(["hello there"], SamplingParams(**{"max_tokens": 2, **bad}))
    clean(llm)
    (out,) = llm.generate(["hello there"], GOOD)
    assert len(out.outputs[0].token_ids) == 4
    clean(llm)


def test_a_bad_prompt_is_refused_and_leaves_nothing(llm):
    for prompt in ["a\ud800b", "", {"prompt_token_ids": [10**9]}, {"prompt_token_ids": []}, 3.5,
                   "x" * (llm.engine.max_model_len * llm.engine.tokenizer.max_token_chars + 1)]:
        with pytest.raises(InvalidRequestError):
            llm.generate([prompt, "hello"], GOOD)
        clean(llm)


def test_a_request_failing_inside_a_step_is_aborted_alone(llm, monkeypatch):
    """Any exception from one request's sampling fails that request only: the batch goes on, the
    caller gets the error, its blocks are freed and the engine keeps serving."""
    engine = llm.engine
    process = engine.sampler._process

    def fragile(row, req, eos_ids):
        if req.params.top_k == 7 and req.output_token_ids:
            raise RuntimeError("this request's processor broke")
        return process(row, req, eos_ids)

    monkeypatch.setattr(engine.sampler, "_process", fragile)
    doomed = SamplingParams(temperature=0, max_tokens=6, top_k=7, repetition_penalty=1.1, ignore_eos=True)
    a = engine.add_request("ok", "hello there", GOOD)
    b = engine.add_request("doomed", "hello", doomed)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[a].error is None and len(finals[a].outputs[0].token_ids) == 4
    assert finals[b].outputs[0].finish_reason == "abort"
    assert "this request's processor broke" in finals[b].error
    assert len(finals[b].outputs[0].token_ids) == 1  # the first token came before the failure
    clean(llm)
    with pytest.raises(RequestFailedError, match="processor broke"):
        llm.generate(["hello", "there"], [doomed, GOOD])
    clean(llm)
    monkeypatch.undo()
    assert len(llm.generate(["hello there"], GOOD)[0].outputs[0].token_ids) == 4


def test_bad_words_are_prepared_once_and_deduplicated(llm):
    words = ["hello", "there", "hello", " hello "] * 200
    params = llm.engine.prepare_params(SamplingParams(bad_words=words))
    ids = params.bad_words_token_ids
    assert len(ids) == len({tuple(w) for w in ids}) <= 4
    assert llm.engine.prepare_params(params) is params  # already prepared: nothing is done twice


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.none(), st.text(max_size=2))
_ints = st.one_of(st.integers(-3, 30), st.integers(), st.none(), st.booleans(), st.floats(-3, 3))
_fields = {
    "n": _ints, "temperature": _floats, "top_p": _floats, "top_k": _ints, "min_p": _floats,
    "presence_penalty": _floats, "frequency_penalty": _floats, "repetition_penalty": _floats, "seed": _ints,
    "max_tokens": _ints, "min_tokens": _ints, "logprobs": _ints,
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(-2, 400), max_size=3)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(-2, 400), _floats, max_size=3)),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(-2, 400), max_size=3)),
    "bad_words": st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=3)),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({}, optional=_fields))
def test_any_sampling_params_are_refused_at_construction_or_generate(llm, kwargs):
    try:
        params = SamplingParams(**kwargs)
    except InvalidRequestError:
        return
    if (params.max_tokens or 0) > 8:
        params.max_tokens = 8
        params.min_tokens = min(params.min_tokens, 8)
    params.n = min(params.n, 3)
    try:
        outs = llm.generate(["hello there"], params)
    except InvalidRequestError:  # what only the model can check: ids past its vocabulary, logprobs over the cap
        clean(llm)
        return
    assert outs[0].finished and outs[0].error is None
    clean(llm)
