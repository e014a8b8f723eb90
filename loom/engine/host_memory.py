"""Large host buffers reused instead of faulted in anew every step.

glibc's malloc serves each allocation above its mmap threshold (which adapts upward, but to 32 MiB at most) with
fresh pages from the kernel, and every 4 KiB page then faults on first touch. A check of drafts produces such a
buffer each step: 64 requests with 5 drafts are 384 rows of SmolLM2's 49,152 bfloat16 logits, 37.7 MB, and the LM
head took 19.1 ms instead of 8.4 with the buffer reused. Raising the mmap threshold keeps such blocks in malloc's
heap; raising the trim threshold keeps a freed heap top from going back to the kernel, to be faulted in again. The
vLLM CPU backend's advice (preloading tcmalloc) solves the same problem; this needs nothing installed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap and are reused; the largest a step makes are float32 logits of a
# few hundred rows (75 MB at 384 rows) and prompt logprobs' 256 rows at a time (50 MB).
REUSED_UP_TO_BYTES = 256 << 20


def keep_large_allocations(limit: int = REUSED_UP_TO_BYTES) -> bool:
    """Ask glibc's malloc to keep blocks of up to `limit` bytes in its heap and not to trim up to `limit` from its
    top; True where it agreed. A process-wide setting: call it once the model is loaded (so that loading's transient
    buffers have gone back to the kernel). Elsewhere (another libc, another OS) nothing changes and it returns False."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, limit)) and bool(mallopt(M_TRIM_THRESHOLD, limit))
