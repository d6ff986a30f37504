"""The server under load and under fuzzing: a real process, real clients, nothing lost, nothing leaked."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import httpx
import pytest
from helpers import Server

pytestmark = pytest.mark.slow  # end to end: server processes, peers, workers, the default model

MAX_TOKENS = [1, 1, 1, 1, 2, 3, 5, 8, 16, 32, 64]


def make_requests(n: int, seed: int = 0) -> list[dict]:
    """Mixed shapes: chat and completions, streams and not, n 1-4, lists of prompts, many max_tokens=1,
    stop strings, and about 15% of the streams hung up on mid-way."""
    rng = random.Random(seed)
    words = "we the people of the united states in order to form a more perfect union".split()
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))
        body: dict = {"max_tokens": rng.choice(MAX_TOKENS), "n": rng.randint(1, 4), "ignore_eos": True,
                      "temperature": rng.choice([0.0, 0.8]), "seed": i, "stream": rng.random() < 0.6}
        if rng.random() < 0.25:
            body["stop"] = [rng.choice(["e", "th", " a", "\n"])]
        if rng.random() < 0.5:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": text}]
        else:
            path = "/v1/completions"
            body["prompt"] = [text, text[::-1] or "x"][:rng.randint(1, 2)] if rng.random() < 0.4 else text
            if rng.random() < 0.3:
                body["logprobs"] = 1
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        hang_up = body["stream"] and rng.random() < 0.25  # 25% of ~60% streams: ~15% of all requests
        delay = rng.uniform(0, 4) if rng.random() < 0.4 else 0.0  # stragglers meet a busy and an idle server
        out.append({"path": path, "body": body, "hang_up_after": rng.randint(1, 4) if hang_up else None,
                    "delay": delay})
    return out


def expected_choices(body: dict) -> int:
    prompts = body["prompt"] if isinstance(body.get("prompt"), list) else [None]
    return len(prompts) * body["n"]


async def run_one(client: httpx.AsyncClient, url: str, r: dict) -> dict:
    body = r["body"]
    await asyncio.sleep(r["delay"])
    if not body["stream"]:
        resp = await client.post(url + r["path"], json=body)
        d = resp.json()
        if resp.status_code != 200:
            return {"status": resp.status_code, "error": d}
        return {"status": 200, "choices": {c["index"]: c["finish_reason"] for c in d["choices"]},
                "completion_tokens": d["usage"]["completion_tokens"], "errors": 0}
    res: dict = {"status": None, "choices": {}, "completion_tokens": None, "errors": 0, "chunks": 0}
    async with client.stream("POST", url + r["path"], json=body) as resp:
        res["status"] = resp.status_code
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                res["errors"] += 1
                continue
            res["chunks"] += 1
            for c in d["choices"]:
                if c.get("finish_reason"):
                    res["choices"][c["index"]] = c["finish_reason"]
            if d.get("usage"):
                res["completion_tokens"] = d["usage"]["completion_tokens"]
            if r["hang_up_after"] and res["chunks"] >= r["hang_up_after"]:
                res["hung_up"] = True
                break
    return res


@pytest.fixture(scope="module")
def small_pool_server(chat_model_dir):
    # 48 blocks of 16 = 768 token slots for 300 requests of up to 4 x (30 + 64) tokens: preempts
    s = Server(chat_model_dir, "--num-kv-blocks", "48", "--block-size", "16", "--max-model-len", "384",
               "--max-num-batched-tokens", "256")
    yield s
    assert s.stop() == 0


def drained(srv: Server, timeout: float) -> tuple[float, float, float]:
    """(running, waiting, KV blocks used) once all are 0, or at the timeout. From one scrape each time: read one
    after the other, a sequence preempted or rescheduled between the reads can read 0 in both gauges."""
    deadline = time.time() + timeout
    while True:
        m = srv.metrics()
        left = (m.get("num_requests_running", 0.0), m.get("num_requests_waiting", 0.0), m.get("kv_cache_blocks_used", 0.0))
        if left == (0, 0, 0) or time.time() > deadline:
            return left
        time.sleep(0.1)


def test_300_concurrent_mixed_requests_lose_nothing(small_pool_server):
    srv = small_pool_server
    reqs = make_requests(300)

    async def all_of_them() -> list[dict]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            return await asyncio.gather(*(run_one(client, srv.url, r) for r in reqs))

    t0 = time.time()
    results = asyncio.run(all_of_them())
    counts = {"requests": len(reqs), "5xx": 0, "non_200": 0, "error_events": 0, "hung_up": 0, "completed": 0,
              "choices": 0}
    for r, res in zip(reqs, results):
        counts["5xx"] += res["status"] >= 500
        counts["non_200"] += res["status"] != 200
        counts["error_events"] += res.get("errors", 0)
        if res.get("hung_up"):
            counts["hung_up"] += 1
            continue
        counts["completed"] += 1
        body = r["body"]
        want = expected_choices(body)
        assert sorted(res["choices"]) == list(range(want)), (r, res)
        counts["choices"] += want
        reasons = set(res["choices"].values())
        assert reasons <= ({"length", "stop"} if body.get("stop") else {"length"}), (r, res)
        if reasons == {"length"}:  # exactly its token count
            assert res["completion_tokens"] == want * body["max_tokens"], (r, res)
        else:
            assert res["completion_tokens"] <= want * body["max_tokens"], (r, res)
    print(f"\nload test: {counts}, {time.time() - t0:.1f} s, preemptions {srv.metric('num_preemptions_total'):.0f}")
    assert counts["5xx"] == 0 and counts["non_200"] == 0 and counts["error_events"] == 0
    assert counts["hung_up"] >= 20 and counts["completed"] >= 250
    assert drained(srv, 10) == (0, 0, 0)  # hung-up streams are aborted as soon as the server notices
    assert srv.metric("num_preemptions_total") > 0  # the pool was small enough to preempt


def test_a_client_that_never_reads_does_not_stall_others(small_pool_server):
    srv = small_pool_server
    body = json.dumps({"prompt": "We the People", "max_tokens": 300, "ignore_eos": True, "n": 4, "stream": True,
                       "logprobs": 5}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read from it
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        t0 = time.time()
        while time.time() - t0 < 10 and not srv.metric("num_requests_running"):
            time.sleep(0.01)
        for _ in range(5):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60)
            assert r.status_code == 200
        # the unread request still runs to its end in the engine; its sequences take turns in the small pool,
        # so at a given moment all of them may be preempted (waiting) rather than running
        left = drained(srv, 180)
        if left != (0, 0, 0):  # is the engine still stepping, and what does it hold?
            tokens = [srv.metric("generation_tokens_total")]
            time.sleep(2)
            tokens.append(srv.metric("generation_tokens_total"))
            snapshot = httpx.get(srv.url + "/kv/snapshot", timeout=30).text
            pytest.fail(f"left (running, waiting, blocks) {left}; generated tokens 2 s apart {tokens}\n"
                        f"KV snapshot: {snapshot[:3000]}\nserver log: {srv.output()[-3000:]}")
    assert httpx.get(srv.url + "/health").status_code == 200


def test_fuzzed_requests_never_get_a_5xx(chat_model_dir):
    """schemathesis over the server's own OpenAPI schema, valid and invalid bodies, bounded in examples and
    derandomized. The schema carries the model's bounds (name, vocabulary, max_model_len), so most valid-mode
    generation requests reach the engine and generate."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    srv = Server(chat_model_dir, "--num-kv-blocks", "64", "--max-model-len", "256")
    counts: dict[int, int] = {}
    generation: dict[int, int] = {}  # valid-mode completions and chat
    try:
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        ops = [r.ok() for r in schema.get_all_operations()]
        assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
        for op in ops:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @settings(max_examples=60, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def fuzz(case) -> None:
                    r = case.call(base_url=srv.url, timeout=120)
                    counts[r.status_code] = counts.get(r.status_code, 0) + 1
                    if mode == GenerationMode.POSITIVE and op.path in ("/v1/completions",  # noqa: B023 - called at once
                                                                       "/v1/chat/completions"):
                        generation[r.status_code] = generation.get(r.status_code, 0) + 1
                    assert r.status_code < 500, (case.method, case.path, case.body, r.text)

                try:
                    fuzz()
                except Unsatisfiable:  # an operation without parameters has no invalid form
                    pass
        ok = generation.get(200, 0) / max(1, sum(generation.values()))
        print(f"\nfuzz: {sum(counts.values())} requests, by status {dict(sorted(counts.items()))}; valid-mode "
              f"generation: {sum(generation.values())}, {ok:.0%} 200")
        # the share moves with the process's string-hash seed (the strategies' order follows it): 46-87% in the
        # runs seen; what it guards is that the schema's bounds let generation requests through at all
        assert sum(counts.values()) >= 300 and ok >= 0.3
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        assert srv.stop() == 0
