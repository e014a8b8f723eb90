"""The memory side of the roofline, measured in the process that runs the engine.

The matmul peak says how fast a step could go if only its FLOPs counted. But a step also streams every weight of the
model from memory once, and every running request's K/V once, while a decode token does only 2 FLOPs per weight: at
64 running requests a bfloat16 step does at most 64 FLOPs per byte it reads, fewer with the K/V, against a
machine that does ~100 times more FLOPs per second than it reads bytes. So here each step's roofline time is the
larger of its matmul FLOPs at the measured matmul peak and its bytes at the measured read bandwidth, and a run's is
the sum over its steps: the time the run could not beat on this machine unless its data sat in cache.
"""

from __future__ import annotations

import time

import torch

from loom.engine.trace import StepRecord


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second at which `torch.sum` reads a float32 buffer of `nbytes` (far larger than the caches), the
    best of `repeats`: the rate every step's bytes are held to (the best, so that roofline times err short)."""
    buffer = torch.ones(nbytes // 4)
    buffer.sum()  # warm-up: pages touched, threads started
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best


def weight_bytes(model) -> int:
    """Bytes of the layer matmuls' and the LM head's weights as the model's matmul backend holds them (padding and
    quantization included): what one forward streams from memory, since they do not fit in cache together."""
    linears = [*model.layer_linears(), model.lm_head]
    return sum(t.nbytes for lin in linears for t in vars(lin).values() if isinstance(t, torch.Tensor))


def run_roofline(records: list[StepRecord], layer_matmul_params: int, lm_head_params: int, weights: int,
                 kv_bytes_per_slot: float, kv_bytes_per_token: float, peak_flops: float, bandwidth: float) -> dict:
    """Per step: its matmul FLOPs at `peak_flops` against its bytes at `bandwidth` (every weight once, each filled KV
    slot of the running requests' blocks read once, the new tokens' K/V written in every layer); the run's roofline
    time is the sum of the larger of each step's two. Attention's FLOPs and the activations' bytes are left out, so
    the time errs short. A slot holds one token of one KV cache group's layers (all of them in a one-group model),
    and a sliding group holds only its window's blocks, so slots count the bytes the kernels read."""
    total_flops = compute_s = memory_s = roofline_s = 0.0
    memory_bound = 0
    for r in records:
        tokens = r.prefill_tokens + r.decode_tokens + r.pad_tokens
        flops = 2.0 * (tokens * layer_matmul_params + r.sampled_tokens * lm_head_params)
        moved = weights + r.tokens_in_cache * kv_bytes_per_slot + tokens * kv_bytes_per_token
        step_compute, step_memory = flops / peak_flops, moved / bandwidth
        total_flops += flops
        compute_s += step_compute
        memory_s += step_memory
        roofline_s += max(step_compute, step_memory)
        memory_bound += step_memory > step_compute
    return {
        "matmul_flops": total_flops,
        "roofline_seconds": roofline_s,
        "roofline_compute_seconds": compute_s,
        "roofline_memory_seconds": memory_s,
        "memory_bound_step_share": memory_bound / max(1, len(records)),
    }
