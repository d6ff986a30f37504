"""The process's heap, tuned for a step loop that frees and reallocates the same large tensors every step.

glibc's malloc serves blocks over its mmap threshold (128 KiB at first, rising as such blocks are freed) with
mmap, and gives the top of the heap back to the kernel when over 128 KiB of it is free. Every step of a serving
loop allocates activations of megabytes (a 2048-token chunk's gate_up output alone is 25 MB of fp32) and frees
them again, so each step maps, faults in (the kernel zeroes every 4 KiB page) and unmaps them anew. On the
mixed workload that was ~3M page faults and 7 s of kernel time in a 13 s run. vLLM's CPU
worker avoids the same cost by preloading tcmalloc; here the engine raises both of glibc's thresholds, which
needs nothing preloaded, so freed activations are reused from the heap. The cost: the heap keeps its peak size
(up to ``TRIM_THRESHOLD`` of it free) instead of returning it between steps; a server gives it back when it goes
idle (``release_freed_memory``), so a burst, or a hostile request's large body, does not stay resident.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("pagedllm")

# mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold over half its largest heap (HEAP_MAX_SIZE: 64 MiB on 64-bit)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library is not glibc
    (musl, macOS: nothing to do, or nothing this knows how to do). Idempotent."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already in the process (find_library would spawn ldconfig)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: others lack it)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the heap thresholds; large activations are mapped anew each step")
    return ok


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel (glibc's malloc_trim); False off glibc. Milliseconds:
    for idle moments, never between steps."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
