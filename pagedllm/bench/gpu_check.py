"""The GPU check: one run that measures what the Triton backend claims on a GPU, every figure into one JSON.

Sections (each on its own: one that fails records its error and the rest go on):
- parity: tiny random models of several families, greedy, against HF transformers on the same device (fp32:
  token for token; bf16: the share of equal tokens and the first divergence);
- kernels: the Triton attention against the torch reference (gathered blocks + SDPA in fp32) on Llama-3-8B
  shapes (32 heads, 8 KV heads, dim 128, blocks of 16), bf16 and fp8 pools: error and time;
- decode: the decode step of a Llama-3-8B-shaped random bf16 model at batch 1, 16, 64 against its HBM floor
  (weight bytes + KV bytes read per step / the card's bandwidth);
- small: the decode step of a SmolLM2-135M-shaped model at batch 1 (the launch-bound case);
- throughput: 256 requests of the mixed workload on the 8B shape;
- seed13b: the seed's 13B case within an 80 GB budget: concurrent sequences paged against max-length reservation.
`--tiny` runs every section on small shapes (a CPU dry run of the script itself, in Triton's interpreter).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
LLAMA2_13B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=5120,
                  intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
TINY_SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet


def _folder(cfg: dict) -> str:
    d = Path(tempfile.mkdtemp(prefix="gpucheck-"))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parity(device: str, tiny: bool) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from conftest import make_tiny_model

    from pagedllm import LLM, SamplingParams

    out = {}
    prompts = [list(range(5, 5 + n)) for n in (7, 30, 61)]
    for arch in ("llama", "gemma3", "gpt-oss", "qwen3"):
        path = tempfile.mkdtemp(prefix=f"tiny-{arch}-")
        hf = make_tiny_model(arch, path)
        for dtype in ("float32", "bfloat16"):
            tdtype = getattr(torch, dtype)
            model = hf.to(device=device, dtype=tdtype).eval()
            want = []
            for p in prompts:
                ids = torch.tensor([p], device=device)
                with torch.no_grad():
                    g = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
                want.append(g[0, len(p):].tolist())
            llm = LLM(model=path, dtype=dtype, device=device, attention_backend="triton", kv_cache_memory="256MiB",
                      max_num_batched_tokens=32)
            got = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
            same = sum(a == b for w, g_ in zip(want, got) for a, b in zip(w, g_))
            first = [next((i for i, (a, b) in enumerate(zip(w, g_)) if a != b), None) for w, g_ in zip(want, got)]
            out[f"{arch}/{dtype}"] = {"equal_tokens": f"{same}/{sum(map(len, want))}", "first_divergence": first,
                                      "backend": type(llm.engine.runner.model.backend).__name__}
            llm.engine.shutdown()
            del llm
    return out


def _reference(q, k_pool, v_pool, tables, ctx_lens, q_lens, scale, k_scale=None, v_scale=None):
    """fp32 gathered-block attention, rows [sum q_lens, H, D]."""
    from pagedllm.model_executor.attention import sdpa

    outs, bs = [], k_pool.shape[1]
    row = 0
    for t, ctx, ql in zip(tables, ctx_lens, q_lens):
        nb = -(-ctx // bs)
        kk, vv = k_pool[t[:nb]], v_pool[t[:nb]]
        if k_scale is not None:
            kk = kk.float() * k_scale[t[:nb]].float().unsqueeze(-1)
            vv = vv.float() * v_scale[t[:nb]].float().unsqueeze(-1)
        kk = kk.reshape(-1, *k_pool.shape[2:])[:ctx].float()
        vv = vv.reshape(-1, *v_pool.shape[2:])[:ctx].float()
        qq = q[row:row + ql].float()
        qpos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
        mask = (torch.arange(ctx, device=q.device)[None] <= qpos)[None, None]
        o = sdpa(qq.transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], mask, False, scale,
                 None)
        outs.append(o[0].transpose(0, 1))
        row += ql
    return torch.cat(outs)


def kernels(device: str, tiny: bool) -> dict:
    from pagedllm.model_executor.kv_quant import quantize
    from pagedllm.model_executor.triton_ops.attention import attend, device_rows

    h, kvh, d, bs = (8, 2, 64, 16) if tiny else (32, 8, 128, 16)
    cases = {"decode_b64_ctx2048": ([1] * 64, [2048] * 64), "decode_b4_ctx8192": ([1] * 4, [8192] * 4),
             "chunk_512_after_1536": ([512], [2048])}
    if tiny:
        cases = {"decode_b4_ctx64": ([1] * 4, [64] * 4), "chunk_16_after_24": ([16], [40])}
    out = {}
    for name, (q_lens, ctx_lens) in cases.items():
        nbs = [-(-c // bs) for c in ctx_lens]
        perm = torch.randperm(sum(nbs) + 1, device=device)[: sum(nbs)]
        tables, i = [], 0
        for nb in nbs:
            tables.append(perm[i:i + nb])
            i += nb
        nblocks = sum(nbs) + 1
        q = torch.randn(sum(q_lens), h, d, device=device, dtype=torch.bfloat16)
        meta, qs = [], 0
        for ql, c in zip(q_lens, ctx_lens):
            meta.append((qs, ql, c))
            qs += ql
        nd = sum(1 for ql in q_lens if ql == 1)
        rows = device_rows([t.tolist() for t in tables], meta, nd, torch.device(device))
        for pool in ("bf16", "fp8_e4m3"):
            kf = torch.randn(nblocks, bs, kvh, d, device=device)
            vf = torch.randn(nblocks, bs, kvh, d, device=device)
            if pool == "bf16":
                kp, vp, ks, vs = kf.bfloat16(), vf.bfloat16(), None, None
            else:
                kp, ks = quantize(kf, torch.float8_e4m3fn)
                vp, vs = quantize(vf, torch.float8_e4m3fn)
            o = torch.empty_like(q)
            args = (q, kp.float() if ks is None else kp, vp.float() if vs is None else vp, tables, ctx_lens, q_lens,
                    d ** -0.5, ks, vs)

            def run(o=o, q=q, kp=kp, vp=vp, rows=rows, ks=ks, vs=vs) -> None:
                attend(o, q, kp, vp, rows, d ** -0.5, None, None, ks, vs)

            run()
            ref = _reference(*args)
            err = (o.float() - ref).abs().max().item()
            entry = {"max_abs_err_vs_fp32": err}
            if device.startswith("cuda"):
                from triton.testing import do_bench

                entry["triton_us"] = do_bench(run) * 1e3
                entry["torch_ref_us"] = do_bench(lambda args=args: _reference(*args)) * 1e3
                kv_bytes = sum(ctx_lens) * kvh * d * 2 * kp.element_size()
                entry["kv_gb_per_s"] = kv_bytes / (entry["triton_us"] * 1e-6) / 1e9
            out[f"{name}/{pool}"] = entry
    return out


def _runner_for(cfg: dict, device: str, num_blocks: int, dtype=torch.bfloat16):
    from pagedllm.model_executor.model_loader.base import model_class
    from pagedllm.model_executor.model_loader.hf import dummy_model
    from pagedllm.model_executor.model_runner import ModelRunner
    from pagedllm.platforms import current_platform

    cls = model_class(cfg, None)
    model = dummy_model(cls, cls.config_from_hf(cfg), dtype, current_platform(device, "triton"))
    return model, ModelRunner(model, num_blocks, 16, dtype)


def _decode_ms(runner, batch: int, ctx: int, device: str, steps: int) -> float:
    from pagedllm.model_executor.model_runner import Batch, BatchItem

    nb = -(-ctx // 16)
    tables = {str(i): list(range(i * nb, (i + 1) * nb)) for i in range(batch)}
    items = [BatchItem(str(i), ctx - 1, [7], 1) for i in range(batch)]
    for _ in range(3):
        runner.execute_batch(Batch(items), [tables])
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        runner.execute_batch(Batch(items), [tables])
    _sync(device)
    return (time.perf_counter() - t) / steps * 1e3


def decode(device: str, tiny: bool) -> dict:
    cfg = TINY_SHAPE if tiny else LLAMA3_8B
    ctx = 256 if tiny else 1024
    batches = (1, 4) if tiny else (1, 16, 64)
    model, runner = _runner_for(cfg, device, max(batches) * -(-ctx // 16))
    weight_bytes = model.step_weight_bytes()
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] //
                                                                               cfg["num_attention_heads"]) * 2
    out = {"weight_gb": weight_bytes / 1e9, "context": ctx}
    for b in batches:
        ms = _decode_ms(runner, b, ctx, device, 3 if tiny else 20)
        floor = (weight_bytes + b * ctx * kv_per_token) / HBM_BYTES_PER_S * 1e3
        out[f"batch{b}"] = {"eager_step_ms": ms, "hbm_floor_ms": floor, "eager_x_floor": ms / floor}
    out["graphs_captured"] = runner.use_decode_graphs(max(batches), 2 * ctx, capture=device.startswith("cuda"))
    for b in batches:
        ms = _decode_ms(runner, b, ctx, device, 3 if tiny else 20)
        out[f"batch{b}"].update(graph_step_ms=ms, graph_x_floor=ms / out[f"batch{b}"]["hbm_floor_ms"])
    if out["graphs_captured"] and device.startswith("cuda"):  # the replay alone: the GPU's share of a step
        for b in batches:
            graph = runner.graphs.graphs[runner.graphs.bucket(b)][0]
            _sync(device)
            t = time.perf_counter()
            for _ in range(20):
                graph.replay()
            _sync(device)
            ms = (time.perf_counter() - t) / 20 * 1e3
            out[f"batch{b}"].update(replay_ms=ms, replay_x_floor=ms / out[f"batch{b}"]["hbm_floor_ms"])
    del runner, model
    return out


def small(device: str, tiny: bool) -> dict:
    cfg = TINY_SHAPE if tiny else SMOLLM2_135M
    model, runner = _runner_for(cfg, device, 64)
    out = {}
    for b in (1, 8):
        out[f"batch{b}_eager_step_ms"] = _decode_ms(runner, b, 64, device, 3 if tiny else 50)
    if device.startswith("cuda"):  # where the time goes: the kernels' GPU time against the step's wall time
        from torch.profiler import ProfilerActivity, profile

        from pagedllm.model_executor.model_runner import Batch, BatchItem

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                runner.execute_batch(Batch([BatchItem("0", 63, [7], 1)]), [{"0": [0, 1, 2, 3]}])
            _sync(device)
        gpu_us = sum(e.self_device_time_total for e in prof.key_averages()) / 10
        out["batch1_gpu_busy_ms"] = gpu_us / 1e3
        out["batch1_kernel_launches"] = sum(e.count for e in prof.key_averages()) / 10
        top = sorted(prof.key_averages(), key=lambda e: -e.count)[:20]
        out["batch1_kernels_by_count"] = [[e.key[:80], e.count / 10, e.self_device_time_total / 10] for e in top]
    out["graphs_captured"] = runner.use_decode_graphs(8, 128, capture=device.startswith("cuda"))
    for b in (1, 8):
        out[f"batch{b}_graph_step_ms"] = _decode_ms(runner, b, 64, device, 3 if tiny else 50)
        out[f"batch{b}_graph_speedup"] = out[f"batch{b}_eager_step_ms"] / out[f"batch{b}_graph_step_ms"]
    return out


def throughput(device: str, tiny: bool) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.tools.workloads import mixed

    cfg = TINY_SHAPE if tiny else LLAMA3_8B
    n = 4 if tiny else 256
    items = mixed(n, cfg["vocab_size"], 0)
    llm = LLM(model=_folder(cfg), load_format="dummy", dtype="bfloat16", device=device, attention_backend="triton",
              **({"kv_cache_memory": "64MiB"} if tiny else {}))
    llm.generate([{"prompt_token_ids": items[0].prompt_token_ids}], SamplingParams(max_tokens=4, ignore_eos=True))
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": it.prompt_token_ids} for it in items],
                        [SamplingParams(max_tokens=it.max_tokens, temperature=0, ignore_eos=True) for it in items])
    dt = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(it.prompt_token_ids) for it in items)
    res = {"requests": n, "seconds": dt, "output_tok_per_s": gen / dt, "total_tok_per_s": (gen + prompt) / dt,
           "kv_blocks": llm.engine.block_manager.num_blocks}
    llm.engine.shutdown()
    return res


def seed13b(device: str, tiny: bool) -> dict:
    """80 GB for weights, activations and KV (memory_utilization = 80 GB / the card); requests of the seed's
    kind (prompts 16..384, outputs 8..256 tokens) against max_model_len 4096: max-length reservation holds
    KV tokens / 4096 sequences; paging holds what the requests use. Counted: the most sequences running at once."""
    from pagedllm import SamplingParams
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.tools.workloads import mixed

    cfg = TINY_SHAPE if tiny else LLAMA2_13B
    opts = dict(kv_cache_memory="8MiB") if tiny else {}
    if not tiny:
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        opts["memory_utilization"] = 80e9 / total
    max_len = 1024 if tiny else 4096
    eng = LLMEngine(EngineConfig(model=_folder(cfg), load_format="dummy", dtype="bfloat16", device=device,
                                 attention_backend="triton",
                                 max_model_len=max_len, max_num_seqs=1024, max_num_batched_tokens=8192, **opts))
    kv_tokens = eng.block_manager.num_blocks * eng.config.block_size
    items = mixed(24 if tiny else 1024, cfg["vocab_size"], 1)
    for i, it in enumerate(items):
        eng.add_request(str(i), {"prompt_token_ids": it.prompt_token_ids},
                        SamplingParams(max_tokens=it.max_tokens, temperature=0, ignore_eos=True))
    peak, steps, t = 0, 0, time.perf_counter()
    while eng.has_unfinished_requests() and time.perf_counter() - t < (60 if tiny else 150):
        eng.step()
        steps += 1
        peak = max(peak, len(eng.scheduler.running))
    res = {"weight_gb": eng.runner.model.step_weight_bytes() / 1e9,
           "kv_gb": eng.block_manager.num_blocks * eng.bytes_per_block / 1e9,
           "kv_tokens": kv_tokens, "max_model_len": max_len, "reservation_holds": kv_tokens // max_len,
           "paged_peak_running": peak, "steps": steps, "seconds": time.perf_counter() - t,
           "finished_all": not eng.has_unfinished_requests()}
    res["ratio"] = peak / max(1, res["reservation_holds"])
    eng.shutdown()
    return res


SECTIONS = {"parity": parity, "kernels": kernels, "decode": decode, "small": small, "throughput": throughput,
            "seed13b": seed13b}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes: a dry run of the script (CPU interpreter)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--out", default="gpu_check.json")
    a = p.parse_args()
    res: dict = {"torch": torch.__version__}
    if a.device.startswith("cuda"):
        import triton

        res["gpu"] = torch.cuda.get_device_name()
        res["triton"] = triton.__version__
    for name in a.sections.split(","):
        t = time.perf_counter()
        try:
            res[name] = SECTIONS[name](a.device, a.tiny)
        except Exception as e:  # noqa: BLE001 - one section's failure is recorded, the others still run
            res[name] = {"error": repr(e), "trace": traceback.format_exc()[-3000:]}
        res[name]["section_seconds"] = time.perf_counter() - t
        gc.collect()  # the section's engine and model (cycles hold them): the next one's budget is the card's
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(json.dumps({name: res[name]}, indent=1), flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
