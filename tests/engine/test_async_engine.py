"""The server's engine loop in-process: streams owned by their handlers, engine failures contained."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncEngine, NewRequest


async def started(model: str) -> AsyncEngine:
    eng = AsyncEngine(EngineConfig(model=model, num_kv_blocks=32, block_size=16))
    await eng.start()
    while eng.engine is None:
        await asyncio.sleep(0.01)
    return eng


async def collect(eng: AsyncEngine, stream) -> list:
    return [out async for out in eng.stream(stream)]


def test_outputs_wait_for_a_late_reader(llama_dir):
    async def main() -> None:
        eng = await started(llama_dir)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, n=3)
        streams = await eng.add([NewRequest(f"r{i}", {"prompt_token_ids": [1, 2, 3 + i]}, params) for i in range(4)])
        while eng.engine.has_unfinished_requests():  # every request finishes before anyone reads
            await asyncio.sleep(0.01)
        for s in streams:
            outs = await collect(eng, s)
            assert outs[-1].finished and [len(c.token_ids) for c in outs[-1].outputs] == [1, 1, 1]
        await eng.stop()

    asyncio.run(main())


def test_an_engine_failure_fails_live_requests_frees_everything_and_keeps_serving(llama_dir):
    async def main() -> None:
        eng = await started(llama_dir)
        real = eng.engine.runner.execute  # a forward that raises is the batch's failure, not one request's
        calls = {"n": 0}

        def failing(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected")
            return real(*a, **kw)

        eng.engine.runner.execute = failing
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=2)
        streams = await eng.add([NewRequest(f"f{i}", {"prompt_token_ids": [5, 6, 7 + i]}, params) for i in range(3)])
        for s in streams:
            with pytest.raises(RuntimeError, match="engine failure: injected"):
                await collect(eng, s)
        await asyncio.sleep(0.05)
        core = eng.engine
        assert not core.groups and not core.scheduler.running and not core.scheduler.waiting
        assert core.block_manager.num_used_blocks == 0
        (s,) = await eng.add([NewRequest("after", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=4))])
        outs = await collect(eng, s)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        await eng.stop()

    asyncio.run(main())


def test_a_drain_refuses_new_requests_and_aborts_running_ones_after_its_timeout(llama_dir):
    from pagedllm.engine.async_engine import ShuttingDownError

    async def main() -> None:
        eng = await started(llama_dir)
        # 500 tokens of the tiny model take 0.3+ s at its fastest: far past the drain's timeout
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        (s,) = await eng.add([NewRequest("long", {"prompt_token_ids": [1, 2, 3]}, params)])
        eng.drain(0.05)
        assert not eng.ready
        with pytest.raises(ShuttingDownError):
            await eng.add([NewRequest("late", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=2))])
        outs = await collect(eng, s)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert eng.engine.block_manager.num_used_blocks == 0
        assert await eng.stop(timeout=5)

    asyncio.run(main())


def test_stop_gives_up_on_a_step_that_never_returns(llama_dir):
    """The server then exits the process itself (cli.cmd_serve) instead of waiting on the stuck thread."""
    import threading

    async def main() -> None:
        eng = await started(llama_dir)
        release = threading.Event()
        step = eng.engine.step
        eng.engine.step = lambda: (release.wait(), step())[1]
        await eng.add([NewRequest("stuck", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))])
        await asyncio.sleep(0.2)
        assert await eng.stop(timeout=0.5) is False
        release.set()

    asyncio.run(main())


def test_the_engine_runs_in_one_thread_of_its_own(llama_dir, monkeypatch):
    """Load, adds, steps and stats all run in one thread that is not the event loop's: each thread that runs
    the kernels gets an OpenMP team, and with more team threads than cores the idle workers sleep between
    kernel calls. Other work in the loop's default executor (a handler's tokenization) does not move it."""
    import threading

    import pagedllm.engine.async_engine as ae

    seen: set[threading.Thread] = set()

    class Recording(ae.LLMEngine):
        def __init__(self, *a, **kw) -> None:
            seen.add(threading.current_thread())
            super().__init__(*a, **kw)

        def step(self):
            seen.add(threading.current_thread())
            return super().step()

        def add_request(self, *a, **kw):
            seen.add(threading.current_thread())
            return super().add_request(*a, **kw)

    monkeypatch.setattr(ae, "LLMEngine", Recording)

    async def main() -> None:
        eng = await started(llama_dir)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        busy = [asyncio.to_thread(threading.Event().wait, 0.02) for _ in range(8)]  # the default pool's threads
        streams = []
        for i in range(4):
            streams += await eng.add([NewRequest(f"t{i}", {"prompt_token_ids": [1, 2, 3 + i]}, params)])
        await asyncio.gather(*busy, *(collect(eng, s) for s in streams))
        await eng.stop()

    asyncio.run(main())
    (thread,) = seen
    assert thread is not threading.main_thread() and thread.name.startswith("pagedllm-engine")
