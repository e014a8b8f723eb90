"""Timing the model's matmuls in the process that runs it: the peak every roofline figure is held to, and one
forward's matmuls alone (the decode figure's yardstick)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from loom.model.linear import AmxLinear, AmxQuantizedLinear, Linear, PackedLinear, QuantizedLinear, make_matmul

BLOCK_BACKENDS = {QuantizedLinear: "quantized", AmxQuantizedLinear: "amx_quantized"}  # GGUF blocks


def matmul_backend_name(model) -> str:
    """'quantized' (GGUF blocks), 'amx_quantized' (GGUF blocks on AMX), 'amx', 'packed' or 'torch': how the model runs
    its layer matmuls."""
    names = {**BLOCK_BACKENDS, AmxLinear: "amx", PackedLinear: "packed"}
    return names.get(type(model.layer_linears()[0]), "torch")


def dense_twin(loaded, engine):
    """Where the engine runs GGUF blocks, the same model with its weights dequantized to its dtype on the same matmul
    backend; else None. Blocks trade arithmetic for bytes, so their own matmul peak is lower than the dense one: a
    run held to the blocks' peak alone would look closer to the machine's limit than it is."""
    if type(engine.runner.model.layer_linears()[0]) not in BLOCK_BACKENDS:
        return None
    config = engine.config
    return loaded.build(config.dtype, make_matmul(config.matmul_backend, "none", config.dtype))


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def matmuls_alone(model, rows: int, lm_head_rows: int) -> Callable[[], None]:
    """A closure that runs every matmul of one forward (layers at `rows` rows, LM head at `lm_head_rows`, as the
    model runs it)."""
    linears = model.layer_linears()
    inputs = {lin.in_features: torch.randn(rows, lin.in_features, dtype=model.dtype) for lin in linears}
    head_in = torch.randn(lm_head_rows, model.lm_head.in_features, dtype=model.dtype)

    def run() -> None:
        for lin in linears:
            lin(inputs[lin.in_features])
        if lm_head_rows:
            model.lm_head(head_in)

    return run


def _weight_shapes(model) -> dict[tuple[int, int], Linear]:
    """One Linear of each distinct (out_features, in_features) among the model's layer matmuls and its LM head."""
    shapes = {(lin.out_features, lin.in_features): lin for lin in model.layer_linears()}
    shapes[(model.lm_head.out_features, model.lm_head.in_features)] = model.lm_head
    return shapes


@torch.inference_mode()
def matmul_peak(model, rows_options: tuple[int, ...] = (64, 256, 512, 2048)) -> dict:
    """Best matmul FLOP/s (as the model's matmul backend runs them) over the model's distinct weight shapes and
    several row counts, and the shape and rows that gave it (`peak_rows_shape`, for `shape_gflops`)."""
    best, best_at, per_rows = 0.0, None, {}
    for rows in rows_options:
        flops_total, seconds_total = 0.0, 0.0
        for shape, lin in _weight_shapes(model).items():
            x = torch.randn(rows, shape[1], dtype=model.dtype)
            sec = median_seconds(lambda lin=lin, x=x: lin(x), repeats=3)
            flops = 2.0 * rows * shape[0] * shape[1]
            if flops / sec > best:
                best, best_at = flops / sec, [rows, *shape]
            flops_total += flops
            seconds_total += sec
        per_rows[rows] = round(flops_total / seconds_total / 1e9, 1)
    return {"peak_gflops": round(best / 1e9, 1), "peak_rows_shape": best_at, "gflops_by_rows_all_shapes": per_rows}


@torch.inference_mode()
def shape_gflops(model, rows: int, out_features: int, in_features: int, repeats: int = 21) -> float:
    """FLOP/s of the model's own matmul of one shape at `rows` rows, now: the peak's shape timed again beside a
    figure, so that the figure and its yardstick share the machine's phase (this VM's speed drifts by tens of
    percent within minutes)."""
    lin = _weight_shapes(model)[(out_features, in_features)]
    x = torch.randn(rows, in_features, dtype=model.dtype)
    return 2.0 * rows * out_features * in_features / median_seconds(lambda: lin(x), repeats=repeats) / 1e9
