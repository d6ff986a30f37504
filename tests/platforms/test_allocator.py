import platform
import subprocess
import sys

import pytest

# A fresh process (the thresholds are process-wide): a step loop's worth of 1-30 MiB tensors allocated, touched
# and freed, 4 alive at a time; after two warm-up rounds, a third faults in no new pages (~760k pages touched).
LOOP = """
import random, resource, sys
import torch
from pagedllm.platforms.allocator import keep_freed_memory
print(keep_freed_memory())
rnd = random.Random(0)
sizes = [rnd.randint(1, 30) << 18 for _ in range(200)]
def cycle():
    live = [torch.ones(n) for n in sizes[:4]]
    for n in sizes:
        live.append(torch.ones(n)); live.pop(0)
cycle(); cycle()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_freed_activations_are_reused_not_faulted_in_again():
    out = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True"
    # with glibc's defaults: ~196k (blocks mapped anew, the heap top trimmed). A kept heap can still grow by a block
    # in the third cycle when fragmentation leaves no free chunk big enough: one full-suite run saw 6,656 faults (26
    # MB, one of the larger tensors), so the bound sits an order of magnitude under the failure, not near zero
    assert int(out[1]) < 20_000
