"""Helpers shared by the tests: a `pagedllm serve` subprocess, HF's greedy continuation (the oracle)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import torch


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # like ignore_eos: exactly n tokens, EOS allowed
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str | None, *extra: str) -> None:
        """model None: the embedded default."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: the access log never fills a buffer
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm", "serve", *(["--model", model] if model else []),
                                      "--port", str(self.port), *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become ready")

    def output(self) -> str:
        """What the server printed so far."""
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str, labels: str = "") -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(f"pagedllm:{name}{labels} "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
