"""The device seam: a model on another torch device runs the torch reference backend there, with its KV pool
and every tensor a step makes on that device. No GPU here, so the placement is checked on the CPU: the step
runs under a mode that flags any tensor made without naming its device (one that would land on the host)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.errors import ConfigError
from pagedllm.platforms.torch_device import TorchDevicePlatform

FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.eye,
             torch.as_tensor, torch.randn, torch.rand}


class NamesDevices(TorchFunctionMode):
    """Records each tensor factory call that does not say where the tensor goes."""

    def __init__(self) -> None:
        super().__init__()
        self.unplaced: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            import traceback

            frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/pagedllm/" in f.filename)
            self.unplaced.append(f"{func.__name__} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}")
        return func(*args, **kwargs)


def guard(runner) -> list[str]:
    """Every later step of the runner runs under NamesDevices; the list collects what it flags."""
    execute, seen = runner.execute_batch, []

    def guarded(*a, **k):
        with NamesDevices() as mode:
            out = execute(*a, **k)
        seen.extend(mode.unplaced)
        return out

    runner.execute_batch = guarded
    return seen


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3.5", "qwen3.5-moe", "mixtral", "gpt-oss", "phi4-mini", "olmoe"])
def test_a_device_step_places_every_tensor_and_matches_the_cpu_kernels(tiny_models, monkeypatch, arch):
    """The torch-device platform (here on the CPU) gives HF's greedy tokens, as the C++ kernels do, and a
    step makes no tensor without naming its device."""
    path, _ = tiny_models[arch]
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 30)]
    sp = SamplingParams(max_tokens=8, temperature=0)
    kernels = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16)
    want = [o.outputs[0].token_ids for o in kernels.generate(prompts, sp)]

    import pagedllm.model_executor.model_loader.hf as hf

    monkeypatch.setattr(hf, "current_platform", lambda device, backend="auto": TorchDevicePlatform(device))
    llm = LLM(model=path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16, device="cpu")
    runner = llm.engine.runner
    assert runner.model.backend.__class__.__name__ == "TorchReference"
    assert all(t.device == torch.device("cpu") for c in runner.slot_caches for t in c.pools())
    seen = guard(runner)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]  # a chunked prompt, decodes, two groups
    assert got == want
    assert sorted(set(seen)) == []


def test_an_fp8_pool_on_a_device_places_every_tensor(llama_dir, monkeypatch):
    import pagedllm.model_executor.model_loader.hf as hf

    monkeypatch.setattr(hf, "current_platform", lambda device, backend="auto": TorchDevicePlatform(device))
    llm = LLM(model=llama_dir, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=16,
              kv_cache_dtype="fp8_e4m3", device="cpu")
    runner = llm.engine.runner
    seen = guard(runner)
    out = llm.generate([{"prompt_token_ids": list(range(5, 35))}], SamplingParams(max_tokens=6, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 6
    assert sorted(set(seen)) == []


def test_device_names_and_what_runs_on_the_cpu_only_are_checked_before_loading():
    for bad in ("Cuda", "cuda:x", "", 3):
        with pytest.raises(ConfigError, match="torch device"):
            EngineConfig(device=bad)
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 runs on the CPU only"):
        EngineConfig(device="cuda", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="kv_offload_dir runs on the CPU only"):
        EngineConfig(device="cuda", kv_offload_dir="/tmp/x")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_a_device_this_torch_build_lacks_is_a_clear_error(llama_dir):
    with pytest.raises(ConfigError, match="has no cuda device available"):
        LLM(model=llama_dir, device="cuda", kv_cache_memory="16MiB")
