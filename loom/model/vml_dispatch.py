"""MKL's vector math kernels chosen once, on one thread, before any multi-threaded use.

On CPU, torch hands a contiguous float32 / float64 tensor's cos, sin, exp, log, sqrt (and the others below) to MKL's
VML, each intra-op thread its own chunk. oneMKL picks each function's kernel lazily, on that function's first call;
with oneMKL 2024.2 (what torch's wheels bundle) two threads making that first call at once can leave one of them
running a low-accuracy kernel for its whole chunk, although high accuracy is asked for (pytorch/pytorch#188792). The
next call is right again, so only a process's first sizable call goes wrong. Loom met it in its RoPE table (the
process's first cos): 4640 of its 524288 bfloat16 entries one step off, a prompt's log-probabilities ~0.03 off.
"""

from __future__ import annotations

import torch

# torch's float functions that call MKL's VML on CPU (ATen/cpu/vml.h, IMPLEMENT_VML_MKL).
VML_FUNCTIONS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt",
                 "tan", "tanh", "trunc")


def settle_vml_dispatch() -> None:
    """Calls each VML-backed function once on a one-element float32 and float64 tensor: such a call runs on this
    thread alone, so MKL's kernel choice is made before two threads can race to make it. About 1.5 ms in a fresh
    process, under 0.1 ms again."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x)
