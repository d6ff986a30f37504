"""The host's memory, read without torch (config validation runs before anything heavy is imported)."""

from __future__ import annotations

import os


def host_available_memory() -> int:
    """Memory the host can still give this process (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
