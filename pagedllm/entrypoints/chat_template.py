"""Chat templates rendered in a child process, bounded in time, memory and output size.

A chat template is a program (jinja2), whether it comes from a model file or a request: two
nested loops of 100,000 or a string doubled in a loop can take any amount of time and memory,
and jinja2's sandbox bounds neither. So templates render in one long-lived child process (plain
Python with jinja2; no torch) under an address-space limit; a render that runs past its time
limit gets the child killed and restarted, one that grows past its output limit is stopped, and
either way the caller gets a TemplateLimitError, never a stalled or killed parent.

This file is also the child's program (`python chat_template.py`), so it imports nothing from
the package.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from datetime import datetime
from typing import Any


class TemplateError(ValueError):
    """The template failed to render (its own error, raise_exception, or a limit)."""


class TemplateLimitError(TemplateError):
    """The template ran past its time, memory or output limit."""


def compile_template(source: str):  # jinja2.Template, imported lazily
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        from jinja2 import TemplateError as JinjaError

        raise JinjaError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_bounded(template, context: dict[str, Any], max_chars: int) -> str:
    """Render chunk by chunk, stopping as soon as the output passes max_chars."""
    parts, size = [], 0
    for chunk in template.generate(**context):
        size += len(chunk)
        if size > max_chars:
            raise TemplateLimitError(f"chat template output is over {max_chars} characters")
        parts.append(chunk)
    return "".join(parts)


class TemplateRenderer:
    """Renders templates in a child process; thread-safe (one render at a time)."""

    def __init__(self, timeout: float = 5.0, max_chars: int = 32 * 2**20, max_memory: int = 2 * 2**30) -> None:
        self.timeout, self.max_chars, self.max_memory = timeout, max_chars, max_memory
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    def render(self, source: str, context: dict[str, Any]) -> str:
        """Raises TemplateError (the template's own failure) or TemplateLimitError."""
        try:
            msg = (json.dumps({"template": source, "context": context}, ensure_ascii=False) + "\n").encode()
        except (TypeError, ValueError) as e:
            raise TemplateError(f"chat template context is not JSON-serializable: {e}") from e
        with self._lock:
            proc = self._child()
            try:
                proc.stdin.write(msg)
                proc.stdin.flush()
                line = self._read_line(proc, time.monotonic() + self.timeout)
            except (BrokenPipeError, OSError, TemplateLimitError):
                self._kill()
                raise TemplateLimitError(f"chat template rendering took over {self.timeout:g} s, or over "
                                         f"{self.max_memory // 2**20} MiB of memory; stopped") from None
        reply = json.loads(line)
        if "error" in reply:
            cls = TemplateLimitError if reply.get("limit") else TemplateError
            raise cls(reply["error"])
        return reply["text"]

    def close(self) -> None:
        with self._lock:
            self._kill()

    # ---- the child -----------------------------------------------------------------------
    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            cmd = [sys.executable, "-I", __file__, str(self.max_chars), str(self.max_memory)]
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, bufsize=0)
            self._finalizer = weakref.finalize(self, _kill_process, self._proc)
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            _kill_process(self._proc)
            self._proc = None

    @staticmethod
    def _read_line(proc: subprocess.Popen, deadline: float) -> bytes:
        fd, buf = proc.stdout.fileno(), bytearray()
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TemplateLimitError("timeout")
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # the child died (memory limit)
                raise TemplateLimitError("child exited")
            buf += chunk
        return bytes(buf)


def _kill_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def _serve(max_chars: int, max_memory: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (max_memory, max_memory))
    from jinja2 import TemplateError as JinjaError

    cache: dict[str, Any] = {}
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            template = cache.get(req["template"])
            if template is None:
                if len(cache) >= 16:
                    cache.clear()
                template = cache[req["template"]] = compile_template(req["template"])
            reply: dict[str, Any] = {"text": render_bounded(template, req["context"], max_chars)}
        except TemplateLimitError as e:
            reply = {"error": str(e), "limit": True}
        except MemoryError:
            reply = {"error": f"chat template rendering needed over {max_memory // 2**20} MiB of memory", "limit": True}
        except JinjaError as e:
            reply = {"error": f"chat template failed: {e}"}
        except Exception as e:  # noqa: BLE001 - any failure of the template is its caller's error, not ours
            reply = {"error": f"chat template failed: {type(e).__name__}: {e}"}
        out.write((json.dumps(reply, ensure_ascii=False) + "\n").encode())
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
