"""llama.cpp's server as a throughput baseline (`bench throughput --baseline llama-server`).

llama-server (built from llama.cpp's source: `cmake -B build && cmake --build build --target
llama-server`, or the one llama-cpp-python's source tree builds) runs the same GGUF file with
continuous batching over N slots, on loopback, on a free port; every request of the workload is sent
at once (the server queues what its slots cannot take), greedy, ignore_eos, the same token ids.
One warm-up request first. The server's own peak RSS (VmHWM) is reported.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ModelLoadError
from ..tools.workloads import WorkItem
from .common import now, result_row

log = logging.getLogger("pagedllm.bench")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_server(path: str | None) -> str:
    exe = path or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not exe or not Path(exe).exists():
        raise ModelLoadError("--baseline llama-server needs --llama-server PATH (or LLAMA_SERVER, or llama-server on "
                             "PATH): build it with cmake from llama.cpp's source")
    return exe


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _peak_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class LlamaServer:
    """llama-server on a free loopback port for the duration of a with block: `base` is its URL."""

    def __init__(self, server: str, args: list[str]) -> None:
        self.port = free_port()
        self.cmd = [server, "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", *args]
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        log.info("starting %s", " ".join(self.cmd))
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("llama-server did not become healthy within 300 s")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def post(self, path: str, body: dict, timeout: float = 3600) -> dict:
        return _post(self.base + path, body, timeout)


def run_llama_server(model: Path, work: list[WorkItem], server: str, slots: int, threads: int) -> dict:
    """The workload through llama-server; the row has the fields of common.result_row."""

    ctx = max(len(w.prompt_token_ids) + w.max_tokens for w in work) + 16
    with LlamaServer(server, ["-m", str(model), "-np", str(slots), "-c", str(slots * ctx), "-t", str(threads),
                              "-tb", str(threads), "--cont-batching"]) as srv:
        def one(w: WorkItem) -> dict:
            return srv.post("/completion", {"prompt": w.prompt_token_ids, "n_predict": w.max_tokens,
                                            "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                                            "cache_prompt": False, "return_tokens": True})

        one(WorkItem(work[0].prompt_token_ids[:16], 8))  # warm-up
        t0 = now()
        with ThreadPoolExecutor(max_workers=len(work)) as pool:
            results = list(pool.map(one, work))
        wall = now() - t0
        rss = _peak_rss(srv.proc.pid)
    out_tokens = sum(int(r.get("tokens_predicted", 0)) for r in results)
    version = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=30)
    return result_row(f"llama-server -np {slots}", work, wall, out_tokens, rss, slots=slots, threads=threads,
                      llama_cpp_version=" ".join((version.stdout + version.stderr).split()),
                      token_ids=[list(r.get("tokens", [])) for r in results])
