"""keep_large_allocations: a step's big buffers come back from malloc's heap instead of fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates, fills and frees a 64 MB tensor (a verification step's float32 logits are 75 MB) ten times, after asking
# for the heap to keep such blocks or not, and prints the minor page faults of the last five (the heap settles within
# the first few).
SCRIPT = """
import resource, sys
import torch
from loom.engine.host_memory import keep_large_allocations
if sys.argv[1] == "keep":
    assert keep_large_allocations()
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.empty(16 << 20, dtype=torch.float32)
    buffer.fill_(1.0)
    del buffer
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[5:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_buffers_are_reused_rather_than_faulted_in_again():
    faults = {mode: int(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                                       check=True).stdout)
              for mode in ("keep", "default")}
    # By default each allocation's pages fault in anew (4 KiB pages: 16,384 an allocation; fewer with huge pages).
    assert faults["default"] >= 5 * 16
    assert faults["keep"] <= faults["default"] // 10
