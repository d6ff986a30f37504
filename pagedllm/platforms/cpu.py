"""Optional C++ kernels (paged attention, packed-weight linear, fused norm/rope/activation,
argmax), built on first use with torch's own extension tooling. If the build is not possible, or
PAGEDLLM_NO_CPP=1, the pure-torch paths are used.

The build directory is keyed by everything the binary depends on: the source, the flags, torch's
version and location, Python's version, and this CPU's instruction-set flags (the build uses
-march=native, so a cache copied to, or a home directory shared with, another kind of CPU must never
load it). Checkouts on one venv share a build: it compiles copies of the sources kept in the build
directory, so its commands name the same paths from every checkout and ninja finds its work done
(compiling a checkout's own paths rebuilt it for each one); a fresh venv builds its own. An flock
around the build serializes them, and because a killed builder's flock dies with it, a `lock` file
that torch left behind is known to be stale and is removed instead of waited on forever; so are the
compilers it left running (ninja and its children outlive a killed builder): they are stopped before
anything compiles into the folder again.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from ..config import cache_dir

log = logging.getLogger("pagedllm")

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
PANEL = 48  # output columns per packed weight panel (NR in ops.cpp)


def pack_weight(w: Tensor, strip: int = PANEL) -> Tensor:
    """[O, K] -> [ceil(O / 48), 48 / strip, K, strip]: column panels of w^T, zero-padded, each stored as strips of
    `strip` columns (Ops.f32_strip: what this build's fp32 kernel reads), each contiguous."""
    o, k = w.shape
    if PANEL % strip:
        raise ValueError(f"a strip of {strip} columns does not divide a {PANEL}-column panel")
    p = -(-o // PANEL)
    padded = w.new_zeros(p * PANEL, k)
    padded[:o] = w
    return padded.view(p, PANEL // strip, strip, k).transpose(2, 3).contiguous()


def unpack_weight(packed: Tensor, out_features: int) -> Tensor:
    """Either panel layout back to [O, K]: fp32 strips [P, S, K, 48 / S] or bf16 pairs [P, K/2, 48, 2] (odd K:
    the zero column of the last pair is kept, so pass in_features to slice it off if it matters)."""
    if packed.dtype == torch.bfloat16:  # [P, K2, 48, 2] -> [P, 48, K2, 2] -> [P * 48, 2 * K2]
        p, k2 = packed.shape[:2]
        return packed.permute(0, 2, 1, 3).reshape(p * PANEL, 2 * k2)[:out_features].contiguous()
    p, _, k, _ = packed.shape  # [P, S, K, W] -> [P, S, W, K] -> [P * 48, K]
    return packed.transpose(2, 3).reshape(p * PANEL, k)[:out_features].contiguous()


def pad_bias(b: Tensor) -> Tensor:
    p = -(-b.shape[0] // PANEL)
    padded = b.new_zeros(p * PANEL)
    padded[:b.shape[0]] = b
    return padded


@dataclass(frozen=True)
class Ops:
    paged_attention: object
    attention_qkv: object
    attend_chunks: object
    packed_linear: object
    silu_and_mul: object
    rms_norm: object
    rope_: object
    argmax_rows: object
    pack_bf16: object
    linear_bf16: object
    linear_bf16_silu_mul: object
    linear_bf16_isa: str
    linear_ggml: object
    linear_ggml_silu_mul: object
    linear_ggml_normed: object
    dequantize_ggml: object
    linear_ggml_isa: str
    ggml_repacks: object
    repack_ggml: object
    mask_rows_: object
    shared_prefix_groups: object
    quantize_kv_: object
    quantize_fp8_kv_: object
    MoeExperts: type  # the extension's class, as it names it
    f32_strip: int  # the columns of one strip of packed_linear's panels (pack_weight's strip)
    gated_delta_decode: object

    @property
    def native_bf16(self) -> bool:
        """Whether the bf16 kernels run on the CPU's own bf16 dot products (AMX-BF16 or AVX512-BF16), not on
        widened fp32 FMAs."""
        return self.linear_bf16_isa in ("amx_bf16", "avx512_bf16")


def cpu_isa_flags() -> str:
    """The CPU's feature flags as the kernel reports them (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


def build_key(sources: list[Path], flags: list[str], isa: str) -> str:
    h = hashlib.sha256()
    for src in sources:
        h.update(src.read_bytes())
    h.update(" ".join(flags).encode())
    # torch's location too: the build commands name its headers, so another venv's build is another build
    # (sharing one directory, two venvs would rebuild it in turn)
    h.update(f"{torch.__version__} {Path(torch.__file__).parent} {sys.version_info[:2]} {isa}".encode())
    return h.hexdigest()[:16]


def build_dir(key: str) -> Path:
    return cache_dir() / "ops" / key


def load_extension(name: str, sources: list[Path], flags: list[str], where: Path):  # the module
    """torch's load() in `where`, under an flock that dies with its holder."""
    from torch.utils.cpp_extension import load

    where.mkdir(parents=True, exist_ok=True)
    with open(where / "pagedllm.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process that is building the C++ kernels in %s", where)
            fcntl.flock(lock, fcntl.LOCK_EX)
        _stop_orphaned_compilers(where)
        stale = where / "lock"  # torch's FileBaton; we hold the flock, so whoever made it is gone
        if stale.exists():
            log.warning("removing a stale build lock left by an interrupted build: %s", stale)
            stale.unlink()
        if not any(where.glob(f"{name}*.so")):
            log.warning("building C++ kernels (once, about a minute) in %s", where)
        return load(name=name, sources=[str(s) for s in _staged(sources, where)], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(where), verbose=False)


def _stop_orphaned_compilers(where: Path, wait: float = 10.0) -> None:
    """Kill the processes working in `where` (ninja runs the compilers there): with the flock held, they
    are a killed builder's, and would write the same objects as this build."""
    import signal
    import time

    target = where.resolve()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int(proc.name) != os.getpid() and Path(os.readlink(proc / "cwd")) == target:
                found.append(int(proc.name))
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    if not found:
        return
    log.warning("stopping %d compiler process(es) left in %s by an interrupted build", len(found), where)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in found):
        time.sleep(0.05)


def _staged(sources: list[Path], where: Path) -> list[Path]:
    """The sources and the headers beside them, copied into where/src. A file already there with the same bytes
    is left alone: ninja goes by modification times, so rewriting it would rebuild."""
    staged = where / "src"
    staged.mkdir(exist_ok=True)
    for f in {*sources, *sources[0].parent.glob("*.h")}:
        data, dst = f.read_bytes(), staged / f.name
        if not dst.exists() or dst.read_bytes() != data:
            dst.write_bytes(data)
    return [staged / s.name for s in sources]


_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "ops.cpp", _CSRC / "attention.cpp", _CSRC / "attention_chunks.cpp", _CSRC / "linear_bf16.cpp",
            _CSRC / "linear_ggml.cpp", _CSRC / "linear_x16.cpp", _CSRC / "mask_rows.cpp", _CSRC / "moe.cpp",
            _CSRC / "kv_quant.cpp", _CSRC / "gated_delta_net.cpp"]


def ops_build_dir(extra_flags: tuple[str, ...] = ()) -> Path:
    return build_dir(build_key([*_SOURCES, *sorted(_CSRC.glob("*.h"))], [*_FLAGS, *extra_flags], cpu_isa_flags()))


def build_ops(extra_flags: tuple[str, ...] = ()) -> Ops:
    """Every kernel compiled with -march=native plus `extra_flags`, or its cached build; raises if the build
    fails. Extra flags mask this CPU's instruction sets, so tests run what other CPUs compile (e.g.
    -mno-avx512f -mno-avxvnni -mno-amx-tile: an AVX2-only Zen 3); each set of flags is its own module and build."""
    name = "pagedllm_ops" + ("_" + hashlib.sha256(" ".join(extra_flags).encode()).hexdigest()[:8] if extra_flags else "")
    mod = load_extension(name, _SOURCES, [*_FLAGS, *extra_flags], ops_build_dir(extra_flags))
    return Ops(mod.paged_attention, mod.attention_qkv, mod.attend_chunks, mod.packed_linear, mod.silu_and_mul,
               mod.rms_norm, mod.rope_, mod.argmax_rows, mod.pack_bf16, mod.linear_bf16,
               mod.linear_bf16_silu_mul, mod.linear_bf16_isa(),
               mod.linear_ggml, mod.linear_ggml_silu_mul, mod.linear_ggml_normed, mod.dequantize_ggml,
               mod.linear_ggml_isa(), mod.ggml_repacks, mod.repack_ggml,
               mod.mask_rows_, mod.shared_prefix_groups, mod.quantize_kv_, mod.quantize_fp8_kv_, mod.MoeExperts, mod.f32_strip(),
               mod.gated_delta_decode)


@cache  # one build per process: the compiled library never changes once loaded
def load_ops() -> Ops | None:
    """This process's kernels: None with PAGEDLLM_NO_CPP set (the pure-torch paths); PAGEDLLM_KERNEL_FLAGS adds
    compiler flags, e.g. "-mno-avx512f -mno-avxvnni -mno-amx-tile" to run what an AVX2-only CPU compiles."""
    if os.environ.get("PAGEDLLM_NO_CPP"):
        return None
    flags = tuple(os.environ.get("PAGEDLLM_KERNEL_FLAGS", "").split())
    if flags:
        log.info("C++ kernels built with %s", " ".join(flags))
    try:
        return build_ops(flags)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("C++ kernels unavailable (%s); using the pure-torch paths", e)
        return None


def auto_dtype() -> tuple[torch.dtype, str]:
    """dtype="auto": bf16 weights where the compiled bf16 linear has native bf16 dot products, else fp32.
    The one place that turns the CPU's instruction set into a choice of format."""
    ops = load_ops()
    if ops is None:
        return torch.float32, "no C++ kernels"
    if ops.linear_bf16_isa == "amx_bf16":
        return torch.bfloat16, "this CPU has AMX-BF16 tiles (and AVX512-BF16 dot products for small batches)"
    if ops.native_bf16:
        return torch.bfloat16, "this CPU has AVX512-BF16 dot products"
    return torch.float32, f"no native bf16 dot products on this CPU (bf16 kernel path: {ops.linear_bf16_isa})"


class CpuPlatform:
    """This host's CPU: tensors in RAM, the KV budget from the memory the host has left, the C++ kernels
    built for its instruction set (fp32 and bf16 models), and the dtype `auto` picks from it."""

    name = "cpu"
    device = "cpu"
    decode_graphs = False

    def available_memory_bytes(self) -> int:
        from .memory import host_available_memory

        return host_available_memory()

    def kernels(self, dtype: torch.dtype) -> Ops | None:
        return load_ops() if dtype in (torch.float32, torch.bfloat16) else None

    def auto_dtype(self) -> tuple[torch.dtype, str]:
        return auto_dtype()

    def backend(self) -> None:
        return None  # the model picks CpuKernels or the torch reference by the kernels it was given
