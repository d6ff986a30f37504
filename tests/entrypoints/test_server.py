"""A real server process on a free loopback port, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest
from helpers import Server

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # end to end: server processes, peers, workers, the default model


@pytest.fixture(scope="module")
def server(chat_model_dir):
    s = Server(chat_model_dir, "--num-kv-blocks", "64", "--block-size", "16", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0  # SIGTERM: clean shutdown, exit 0


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_health_ready_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="tiny", prompt="We hold these truths", max_tokens=24, temperature=0.8, seed=7)
    full = client.completions.create(**kw)
    text = full.choices[0].text
    assert full.usage.completion_tokens == 24 or full.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_n2_logprobs_echo_token_prompt(client):
    r = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=5, n=2, temperature=1.0, seed=3,
                                  logprobs=2, echo=True, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        # top-2 plus the sampled token, keyed by text (distinct ids may decode alike)
        assert all(1 <= len(t) <= 3 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 10
    multi = client.completions.create(model="tiny", prompt=["a b", "c d"], max_tokens=3, n=2,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in multi.choices) == [0, 1, 2, 3]


def test_stop_strings(client):
    base = client.completions.create(model="tiny", prompt="The right of", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # a 2-character piece of the greedy text, past its start, free of replacement characters
    cut = next(i for i in range(3, len(base) - 2) if "\ufffd" not in base[i:i + 2])
    stop = base[cut:cut + 2]
    r = client.completions.create(model="tiny", prompt="The right of", max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[:base.index(stop)]
    chunks = client.completions.create(model="tiny", prompt="The right of", max_tokens=30, temperature=0,
                                       stop=[stop], stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_chat_stream_role_usage_and_cached_tokens(client):
    msgs = [{"role": "system", "content": "You are terse. " * 12}, {"role": "user", "content": "Say something."}]
    kw = dict(model="tiny", messages=msgs, max_completion_tokens=16, temperature=0.7, seed=11)
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert first.choices[0].message.role == "assistant"
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the prefix cache served the system prompt
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content
    assert chunks[-1].usage.total_tokens == first.usage.total_tokens
    lp = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3, n=2)
    assert len(lp.choices) == 2
    assert all(len(t.top_logprobs) == 3 for t in lp.choices[0].logprobs.content)


def test_tokenize_detokenize(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Four score and seven"}).json()
    assert r["count"] == len(r["tokens"]) > 0
    d = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == "Four score and seven"


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": 9}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": "hi", "top_k": -7}, 400),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 10, "max_tokens": 5}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": [[]]}, 400),
    ("/v1/completions", {"prompt": [1, 99999]}, 400),
    ("/v1/completions", {"prompt": [-1]}, 400),
    ("/v1/completions", {"prompt": [1.5, 2]}, 400),
    ("/v1/completions", {"prompt": [1] * 1100}, 400),  # longer than max_model_len
    ("/v1/completions", {"prompt": [1] * 1000, "max_tokens": 100}, 400),  # prompt + max_tokens too long
    ("/v1/completions", {"prompt": {"text": "hi"}}, 400),
    ("/v1/completions", {"max_tokens": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 400),
    ("/v1/completions", {"prompt": "hi", "seed": "abc"}, 400),
    ("/v1/completions", {"prompt": "hi", "stream": "maybe"}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template": "{{ raise_exception('no') }}"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, 400),
    ("/tokenize", {}, 400),
    ("/detokenize", {"tokens": [1, 100000]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
]


def test_bad_requests_are_refused_and_server_keeps_serving(server):
    for path, body, status in BAD_REQUESTS:
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] and "param" in err and "code" in err
    raw = [
        (b"{not json", {"content-type": "application/json"}, 400),
        (b'{"prompt": "\xff\xfe bad utf8"}', {"content-type": "application/json"}, 400),
        (b"", {"content-type": "application/json"}, 400),
        (b"[1, 2, 3]", {"content-type": "application/json"}, 400),
        (json.dumps({"prompt": "x" * (9 * 2**20)}).encode(), {"content-type": "application/json"}, 413),
    ]
    for body, headers, status in raw:
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == status, (body[:40], r.status_code, r.text)
        assert "error" in r.json()
    assert len(BAD_REQUESTS) + len(raw) >= 30
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    assert server.metric("num_requests_running") == 0 and server.metric("kv_cache_usage_perc") == 0


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": "Amendment", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        assert server.metric("num_requests_running") == 1
    deadline = time.time() + 1.0
    while time.time() < deadline and (server.metric("num_requests_running") or server.metric("kv_cache_usage_perc")):
        time.sleep(0.05)
    assert server.metric("num_requests_running") == 0 and server.metric("kv_cache_usage_perc") == 0
    assert server.metric("request_success_total", '{finished_reason="abort"}') >= 1


def test_non_streaming_disconnect_aborts(server):
    body = json.dumps({"prompt": "Amendment", "max_tokens": 1000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # send, wait until it runs, hang up
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.time() + 5.0
        while time.time() < deadline and not server.metric("num_requests_running"):
            time.sleep(0.01)
        assert server.metric("num_requests_running") == 1
    deadline = time.time() + 2.0
    while time.time() < deadline and server.metric("num_requests_running"):
        time.sleep(0.05)
    assert server.metric("num_requests_running") == 0 and server.metric("kv_cache_usage_perc") == 0


def test_200_concurrent_streams_on_a_small_pool(chat_model_dir):
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(8, 30))] for _ in range(200)]
    ref = LLM(model=chat_model_dir).generate([{"prompt_token_ids": p} for p in prompts],
                                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    # 40 blocks of 16 = 640 tokens: about 15-20 of these requests at once
    srv = Server(chat_model_dir, "--num-kv-blocks", "40", "--block-size", "16", "--max-model-len", "640")
    try:
        async def one(client: httpx.AsyncClient, p: list[int]) -> tuple[str, int]:
            body = {"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            text, usage = "", None
            async with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        d = json.loads(line[6:])
                        if d["choices"]:
                            text += d["choices"][0]["text"]
                        if d.get("usage"):
                            usage = d["usage"]["completion_tokens"]
            return text, usage

        async def all_of_them() -> list:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        results = asyncio.run(all_of_them())
        assert [t for t, _ in results] == [o.outputs[0].text for o in ref]
        assert sum(u for _, u in results) == 200 * 16
        assert srv.metric("generation_tokens_total") == 200 * 16
        assert srv.metric("request_success_total", '{finished_reason="length"}') == 200
        assert srv.metric("kv_cache_blocks_used") == 0 and srv.metric("num_requests_running") == 0
        assert srv.metric("num_preemptions_total") >= 0
    finally:
        assert srv.stop() == 0


def test_api_key_and_queue_limit(chat_model_dir):
    srv = Server(chat_model_dir, "--api-key", "sekret", "--max-queue-len", "1", "--max-num-seqs", "1")
    try:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(srv.url + "/health").status_code == 200
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.get(srv.url + "/v1/models", headers=auth).status_code == 200
        # the dashboard page carries no data; its snapshot is behind the key
        assert httpx.get(srv.url + "/dashboard").status_code == 200
        assert httpx.get(srv.url + "/dashboard/kvmap.js").status_code == 200
        assert httpx.get(srv.url + "/dashboard/../app.py").status_code in (401, 404)
        assert httpx.get(srv.url + "/kv/snapshot").status_code == 401
        snap = httpx.get(srv.url + "/kv/snapshot", headers=auth).json()
        assert snap["pool"]["num_blocks"] == len(snap["pool"]["state"]) > 0

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=120, headers=auth) as c:
                body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}
                rs = await asyncio.gather(*(c.post(srv.url + "/v1/completions", json=body) for _ in range(6)))
                return [r.status_code for r in rs]

        codes = asyncio.run(burst())
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    finally:
        assert srv.stop() == 0


def test_sigterm_with_live_requests_exits_cleanly(chat_model_dir):
    srv = Server(chat_model_dir, "--shutdown-timeout", "1")
    body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    t0 = time.time()
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(srv.proc.pid, signal.SIGTERM)
        try:
            for _ in lines:  # the stream ends (aborted after the grace period) instead of hanging
                pass
        except httpx.HTTPError:
            pass
    assert srv.proc.wait(timeout=30) == 0
    assert time.time() - t0 < 20


def test_requests_that_finish_in_their_first_step_are_never_lost(server):
    """max_tokens 1-2: the final output can arrive before the handler starts reading it."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for _ in range(30):  # one after another on an idle server
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
        r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a", "b c", "d"], "max_tokens": 2,
                                                             "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            bodies = [{"prompt": [[1 + i, 2], [3, 4 + i]], "max_tokens": 1, "n": 1 + i % 3} for i in range(40)]
            return await asyncio.gather(*(c.post(server.url + "/v1/completions", json=b) for b in bodies))

    rs = asyncio.run(burst())
    assert [r.status_code for r in rs] == [200] * 40
    assert [len(r.json()["choices"]) for r in rs] == [2 * (1 + i % 3) for i in range(40)]


UNSUPPORTED = [
    ("/v1/chat/completions", "functions", [{"name": "f"}]),  # deprecated for tools
    ("/v1/chat/completions", "guided_whitespace_pattern", " "),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "the end"),
    ("/v1/completions", "prompt_logprobs", 1),
    ("/v1/chat/completions", "use_beam_search", True),
    ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "audio", {"voice": "alloy"}),
    ("/v1/completions", "frobnicate", 1),  # in neither API: unrecognized
]


def test_unsupported_fields_are_refused_by_name_not_ignored(server):
    base = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    for path, name, value in UNSUPPORTED:
        r = httpx.post(server.url + path, json={**base[path], name: value}, timeout=30)
        assert r.status_code == 400, (path, name, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"], err
    noops = [("/v1/chat/completions", {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                                       "parallel_tool_calls": True, "user": "u1", "metadata": {"k": "v"}}),
             ("/v1/completions", {"suffix": "", "best_of": 1, "prompt_logprobs": None, "user": "u2"})]
    for path, extra in noops:  # their no-op values are honoured trivially
        r = httpx.post(server.url + path, json={**base[path], **extra}, timeout=30)
        assert r.status_code == 200, (path, r.text)


def test_logit_bias_and_allowed_token_ids(server):
    def complete(**kw) -> dict:
        body = {"prompt": "We the People", "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()

    def ids(text: str) -> list[int]:
        return httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    free = complete()["choices"][0]["text"]
    forced = complete(logit_bias={"100": 100})["choices"][0]["text"]
    assert ids(forced) == [100] * 8 or forced == httpx.post(server.url + "/detokenize",
                                                            json={"tokens": [100] * 8}).json()["prompt"]
    first = ids(free)[0]
    assert ids(complete(logit_bias={str(first): -100})["choices"][0]["text"])[:1] != [first]
    assert complete(allowed_token_ids=[100, 101])["choices"][0]["text"].replace(
        httpx.post(server.url + "/detokenize", json={"tokens": [100]}).json()["prompt"], "").replace(
        httpx.post(server.url + "/detokenize", json={"tokens": [101]}).json()["prompt"], "") == ""
    for bad in [{"logit_bias": {"320": 5}}, {"logit_bias": {"5": 101}}, {"logit_bias": {"abc": 1}},
                {"allowed_token_ids": []}, {"allowed_token_ids": [99999]}, {"bad_words": [""]}]:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", **bad}, timeout=30)
        assert r.status_code == 400, (bad, r.text)


HOSTILE = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"


def test_request_chat_template_refused_unless_trusted(server, chat_model_dir):
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "chat_template": "{{ 'x' }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    srv = Server(chat_model_dir, "--trust-request-chat-template")
    try:
        ok = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "messages": msgs, "max_tokens": 2, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == len(
            httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}).json()["tokens"])
        for template in [HOSTILE, HOSTILE.replace("{{ i }}", ""),
                         "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                         "{% endfor %}{{ ns.s }}"]:
            r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "chat_template": template},
                           timeout=60)
            assert r.status_code == 400 and "chat template" in r.json()["error"]["message"], r.text
            assert httpx.get(srv.url + "/health").status_code == 200
        again = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, timeout=30)
        assert again.status_code == 200
    finally:
        assert srv.stop() == 0
