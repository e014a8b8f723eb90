"""Count a process's idle OpenMP worker threads, to tell how many OpenMP teams it keeps.

Each thread that runs parallel regions keeps its own team of `threads - 1` workers, which libgomp parks in a futex
wait of its own (an inline system call, so the thread's program counter lies inside libgomp). A server whose
parallel regions all start from its engine thread has exactly one team; one more means some other thread ran a
parallel region, and the two teams then share the cores (loom/engine/async_engine.py says what that costs).
"""

from __future__ import annotations

import time
from pathlib import Path


def _libgomp_ranges(pid: int) -> list[tuple[int, int]]:
    ranges = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "libgomp" in Path(fields[5]).name:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def parked_openmp_workers(pid: int, settle_seconds: float = 5.0) -> int:
    """The threads of process `pid` parked inside libgomp, once no thread of it is running (or after
    `settle_seconds`: a worker still spinning after a region is not counted until it parks)."""
    ranges = _libgomp_ranges(pid)
    deadline = time.monotonic() + settle_seconds
    while True:
        parked, running = 0, 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                fields = (task / "syscall").read_text().split()
            except OSError:  # the thread ended meanwhile
                continue
            if fields[0] == "running":
                running += 1
            elif len(fields) > 2 and any(low <= int(fields[-1], 16) < high for low, high in ranges):
                parked += 1
        if not running or time.monotonic() > deadline:
            return parked
        time.sleep(0.05)
