"""Each bench on a tiny random model: JSON fields present and internally consistent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import Server

pytestmark = pytest.mark.slow  # end to end: server processes, peers, workers, the default model


def run_bench(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pagedllm", "bench", *args, "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr


def test_throughput_vs_hf_static(llama_dir, tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    run_bench("throughput", "--model", llama_dir, "--workload", "mixed", "--num-requests", "6", "--dtype", "float32",
              "--batch-size", "2", "4", "--json", str(out), "--plot", str(png), "--max-model-len", "1024")
    d = json.loads(out.read_text())
    assert {"cores", "torch", "threads"} <= d["machine"].keys()
    assert d["config"]["workload"] == "mixed" and d["config"]["batch_size"] == [2, 4]
    from pagedllm.tools.workloads import mixed

    work = mixed(6, 320, 0)
    want_out = sum(w.max_tokens for w in work)
    ours, *base = d["results"]
    assert [r["system"] for r in d["results"]] == ["pagedllm fp32", "hf-static B=2", "hf-static B=4"]
    for r in d["results"]:
        assert r["output_tokens"] == want_out and r["requests"] == 6
        assert r["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in work)
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["peak_rss_bytes"] > 0
    for r in base:
        assert r["pagedllm_speedup"] == pytest.approx(ours["output_tokens_per_s"] / r["output_tokens_per_s"])
        assert 0 < r["wasted_token_fraction"] < 1  # static batches generate past short requests' ends
        assert r["generated_tokens"] > r["output_tokens"]
    assert ours["wasted_token_fraction"] == 0 and 0.5 < ours["kv_utilization"] <= 1
    assert png.stat().st_size > 5000


def test_shared_prefix_workload_hits_cache(llama_dir, tmp_path):
    out = tmp_path / "s.json"
    run_bench("throughput", "--model", llama_dir, "--workload", "shared-prefix", "--num-requests", "8",
              "--baseline", "none", "--json", str(out), "--max-model-len", "1024")
    (ours,) = json.loads(out.read_text())["results"]
    assert ours["prefix_cache_hits"] >= 7 * 512


def test_jsonl_workload(llama_dir, tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt_token_ids": [1, 2, 3], "max_tokens": 4}\n{"prompt_token_ids": [4, 5], "max_tokens": 6}\n')
    out = tmp_path / "j.json"
    run_bench("throughput", "--model", llama_dir, "--workload", str(f), "--baseline", "none", "--json", str(out))
    (ours,) = json.loads(out.read_text())["results"]
    assert ours["output_tokens"] == 10 and ours["prompt_tokens"] == 5


def test_latency(llama_dir, tmp_path):
    out = tmp_path / "l.json"
    run_bench("latency", "--model", llama_dir, "--input-len", "50", "--output-len", "9", "--num-iters", "2",
              "--json", str(out))
    d = json.loads(out.read_text())
    assert len(d["runs"]) == 2 and all(r["output_tokens"] == 9 for r in d["runs"])
    assert d["median"]["ttft_s"] > 0 and d["median"]["decode_tokens_per_s"] > 0
    assert d["prompt_tokens_per_s"] == pytest.approx(50 / d["median"]["ttft_s"])


def test_memory(llama_dir, tmp_path):
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    run_bench("memory", "--model", llama_dir, "--num-requests", "16", "--json", str(out), "--plot", str(png),
              "--max-model-len", "1024")
    d = json.loads(out.read_text())
    s, series = d["summary"], d["series"]
    assert s["peak_static_bytes"] == max(series["static_bytes"]) > s["peak_paged_bytes"] == max(series["paged_bytes"])
    assert all(p >= u for p, u in zip(series["paged_bytes"], series["live_token_bytes"]))
    assert s["paged_utilization"] > s["static_utilization"]
    assert s["peak_concurrency"] == max(series["running"]) <= 16


def test_offload(llama_dir, tmp_path):
    """A 64-token prefix read back after a restart (4 blocks), and 16 requests over 8 documents of 64 tokens whose
    KV is 4x the pool: the tier's run reads documents back, the RAM-only run cannot."""
    out = tmp_path / "o.json"
    run_bench("offload", "--model", llama_dir, "--dtype", "float32", "--block-size", "16", "--prefix-len", "64",
              "--num-docs", "8", "--doc-len", "64", "--num-requests", "16", "--json", str(out))
    d = json.loads(out.read_text())
    r = d["restart"]
    assert r["disk_page_cache_hit_tokens"] == r["disk_cold_hit_tokens"] == 64
    assert r["speedup_cold"] == pytest.approx(r["recompute"] / r["disk_cold"])
    w = d["workload"]
    assert w["pool_bytes"] * 4 == pytest.approx(w["docs_kv_bytes"], rel=1e-6)
    assert w["ram_only"]["disk_hit_tokens"] == 0 < w["disk_tier"]["disk_hit_tokens"]
    assert w["disk_tier"]["offload"]["blocks_saved"] > 0
    assert w["speedup"] == pytest.approx(w["ram_only"]["wall_s"] / w["disk_tier"]["wall_s"])


def test_roofline(llama_dir, tmp_path):
    out = tmp_path / "r.json"
    run_bench("roofline", "--model", llama_dir, "--batch", "4", "--context-len", "16", "--decode-steps", "4",
              "--json", str(out))
    s = json.loads(out.read_text())["summary"]
    assert s["floor_s"] == max(s["bytes_floor_s"], s["flops_floor_s"]) > 0
    assert s["achieved_over_floor"] == pytest.approx(s["achieved_step_s"] / s["floor_s"])


def test_roofline_of_a_workload_counts_the_work_it_did(llama_dir, tmp_path):
    from pagedllm.tools.workloads import mixed

    out = tmp_path / "w.json"
    run_bench("roofline", "--model", llama_dir, "--workload", "mixed", "--num-requests", "5", "--json", str(out))
    s = json.loads(out.read_text())["summary"]
    work = mixed(5, 320, 0)
    # every prompt token once, then each output token but the last goes back through the model
    assert s["tokens_computed"] == sum(len(w.prompt_token_ids) + w.max_tokens - 1 for w in work)
    assert s["compute_floor_s"] == pytest.approx(s["total_TFLOP"] * 1e12 / (s["matmul_GFLOPs"] * 1e9))
    assert s["step_floor_s"] >= s["compute_floor_s"] > 0
    assert s["achieved_over_compute_floor"] == pytest.approx(s["achieved_s"] / s["compute_floor_s"])


def test_serve_bench(chat_model_dir, tmp_path):
    srv = Server(chat_model_dir, "--num-kv-blocks", "64")
    try:
        out = tmp_path / "v.json"
        r = subprocess.run([sys.executable, "-m", "pagedllm", "bench", "serve", "--base-url", srv.url,
                            "--num-requests", "12", "--request-rate", "50", "--json", str(out)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        s = json.loads(out.read_text())["summary"]
        from pagedllm.tools.workloads import mixed

        assert s["completed"] == 12 and s["errors"] == 0
        assert s["output_tokens"] == sum(w.max_tokens for w in mixed(12, 320, 0))
        assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])
        for k in ("ttft_s", "itl_s", "e2e_s"):
            assert s[k]["p50"] <= s[k]["p90"] <= s[k]["p99"]
    finally:
        srv.stop()


def test_f32_gguf_for_llamacpp_keeps_metadata_and_weights(tmp_path, monkeypatch):
    """The llama.cpp baseline's weights: the default GGUF with each tensor dequantized, all else kept."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from pagedllm.bench.llamacpp import f32_gguf
    from pagedllm.model_executor.model_loader import default_model_path

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    src = GGUFReader(str(default_model_path()))
    out = GGUFReader(str(f32_gguf(default_model_path())))
    assert out.fields["general.file_type"].contents() == 0
    for key in ("general.architecture", "tokenizer.ggml.tokens", "tokenizer.chat_template", "llama.block_count"):
        assert out.fields[key].contents() == src.fields[key].contents()
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    assert all(t.tensor_type == GGMLQuantizationType.F32 for t in out.tensors)
    a, b = src.tensors[5], out.tensors[5]
    assert list(a.shape) == list(b.shape)
    assert np.array_equal(dequantize(a.data, a.tensor_type).reshape(-1), np.asarray(b.data).reshape(-1))


def test_llamacpp_baseline_needs_its_package(llama_dir):
    pytest.importorskip("gguf")
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # not installed, or installed without its libllama
        r = subprocess.run([sys.executable, "-m", "pagedllm", "bench", "latency", "--model", llama_dir,
                            "--input-len", "8", "--output-len", "2", "--num-iters", "1", "--baseline", "llama-cpp",
                            "--no-progress"], capture_output=True, text=True, timeout=600)
        assert r.returncode != 0 and "pip install llama-cpp-python" in r.stderr
    else:
        pytest.skip("llama-cpp-python is installed here")


def test_vllm_baseline_needs_its_interpreter(llama_dir):
    r = subprocess.run([sys.executable, "-m", "pagedllm", "bench", "throughput", "--model", llama_dir,
                        "--num-requests", "2", "--baseline", "vllm", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "--vllm-python" in r.stderr


@pytest.mark.parametrize("quantization, warned", [("q8_0", True), ("none", False)])
def test_throughput_says_when_the_baseline_reads_other_weights(llama_dir, quantization: str, warned: bool) -> None:
    """The HF baselines read the dense folder: weights quantized at load (or a GGUF's own formats) are
    not the same weights, and the report says so."""
    r = subprocess.run([sys.executable, "-m", "pagedllm", "bench", "throughput", "--model", llama_dir, "--workload",
                        "mixed", "--num-requests", "2", "--dtype", "float32", "--quantization", quantization,
                        "--batch-size", "2", "--max-model-len", "1024", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert ("pass --quantization none to compare the same weights" in r.stderr) == warned, r.stderr


def test_vllm_gets_the_preloads_its_cpu_guide_asks_for(tmp_path) -> None:
    import platform

    from pagedllm.bench.throughput import vllm_preload

    venv = tmp_path / "venv"
    libs = venv / "lib/python3.11/site-packages/vllm/libs"
    libs.mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "bin/python").touch()
    assert all("/venv/" not in p for p in vllm_preload(str(venv / "bin/python")))  # nothing in the venv yet
    (libs / "libtcmalloc_minimal.so.4").touch()
    (venv / "lib/libiomp5.so").touch()
    want = [str(libs / "libtcmalloc_minimal.so.4")]
    if platform.machine() == "x86_64":
        want.append(str(venv / "lib/libiomp5.so"))
    assert vllm_preload(str(venv / "bin/python")) == want
