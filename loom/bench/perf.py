"""`loom bench perf`: the performance figures Loom is held to, each printed as one JSON line, measured in one process.

- matmul_peak: matmul throughput on the model's own weight shapes, with torch's matmul and with the engine's matmul
  backend (on GGUF blocks, and on the same weights dense); the best of them is the roofline every other figure is
  held to.
- decode: one decode step at B running requests of C tokens of context, against the same step's matmuls alone,
  and how much of the step is spent outside the model forward (scheduling, metadata, sampling, bookkeeping).
- prefill: one long prompt alone, as achieved model FLOP/s and as a fraction of the measured peak (and of that
  peak's own matmul timed again right after each prompt).
- verify: steps that check speculation's drafts (B requests at C tokens of context, each checking d drafts a step)
  against a step that checks none.
- serve_memory: peak RSS of a `loom serve` process on the model after a short burst of requests.
- prefill_interference: p99 inter-token latency of 32 decoding requests while a 4000-token prompt is prefilled,
  per token budget (the chunked-prefill trade-off).
- agreement: greedy bfloat16 outputs against float32 on the first mixed-workload requests.
- kv_footprint: the KV cache one request of C tokens holds in its largest step and while decoding, against one
  block table for every layer; below it only where the model has sliding-window layers.
Timings are medians of several runs; nothing here is asserted, only reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from loom.bench.matmul_timing import (
    dense_twin,
    matmul_backend_name,
    matmul_peak,
    matmuls_alone,
    median_seconds,
    shape_gflops,
)
from loom.bench.memory_roofline import read_bandwidth, weight_bytes
from loom.bench.offline import emit, run_once
from loom.bench.serve_client import free_loopback_port, wait_until_healthy
from loom.bench.workloads import mixed_workload
from loom.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from loom.engine.batch import build_batch_metadata
from loom.engine.engine import LLMEngine
from loom.engine.kv_cache import NULL_BLOCK
from loom.engine.runner import StepResult
from loom.engine.scheduler import SchedulerOutput
from loom.model.layer_ops import FusedLayerOps
from loom.model.linear import make_matmul
from loom.model.loader import LoadedModel, load_model
from loom.sampling import SamplingParams


def layer_ops_name(model) -> str | None:
    """'fused' or 'torch' for a Llama; None for an architecture without pluggable layer ops (GPT-2)."""
    ops = getattr(model, "ops", None)
    return None if ops is None else ("fused" if isinstance(ops, FusedLayerOps) else "torch")


def _random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _running(engine: LLMEngine, rng: random.Random, count: int, context: int, params: SamplingParams) -> list[str]:
    """`count` requests of `context` random prompt tokens, stepped until each has its first output token (all past
    their prompts); their ids."""
    vocab = engine.model_config.vocab_size
    ids = [engine.add_request(_random_prompt(rng, context, vocab), params) for _ in range(count)]
    while any(engine.requests[i].num_output_tokens == 0 for i in ids):
        engine.step()
    return ids


@torch.inference_mode()
def decode_step(engine: LLMEngine, batch: int, context: int, bandwidth: float, seed: int = 0,
                rounds: int = 7) -> dict:
    """Fill the running set with `batch` requests of `context` prompt tokens, then time their decode steps.

    Each of `rounds` rounds times one whole step, with its forward and its logits timed inside it (so the time
    outside them is that same step's), and right after it the step's matmuls alone: ratios are taken within a round,
    so that a noisy machine's slow and fast phases do not fall on one side only. Medians over the rounds.

    Beside the times: the step's floors at `bandwidth` bytes/s (its matmuls stream every weight once; the step adds
    every request's K/V once), whose ratio is the lowest step_over_matmuls that memory allows; and the K/V read rates
    that the step got and would need: its K/V bytes over the time beside its matmuls, and over the matmuls' time (what a
    step of twice its matmuls leaves them, where reads and matmuls do not overlap)."""
    ids = _running(engine, random.Random(seed), batch, context,
                   SamplingParams(max_tokens=64 + rounds, temperature=0.0, ignore_eos=True))
    runner = engine.runner
    model = runner.model
    engine.step()  # warm-up
    steps: list[tuple[SchedulerOutput, StepResult]] = []
    rows: dict[str, list[float]] = {"step": [], "matmuls": []}
    with engine.observing(lambda out, result, *_: steps.append((out, result))):
        for _ in range(rounds):
            started = time.perf_counter()
            engine.step()
            rows["step"].append(time.perf_counter() - started)
            if len(steps) == 1:
                first = steps[0][1].metadata
                run_matmuls = matmuls_alone(model, first.num_tokens, len(first.sampled_scheduled_index))
                run_matmuls()  # warm-up
            started = time.perf_counter()
            run_matmuls()
            rows["matmuls"].append(time.perf_counter() - started)
    rows["forward"] = [result.forward_seconds for _, result in steps]
    rows["logits"] = [result.logits_seconds for _, result in steps]
    out, meta = steps[-1][0], steps[-1][1].metadata
    # Re-running the last step's forward rewrites the same K/V at the same slots: harmless.
    hidden = model.forward(meta, runner.kv_caches, runner.attention)[meta.logits_indices]
    logits = model.compute_logits(hidden)
    requests = [out.scheduled[i].request for i in meta.sampled_scheduled_index]
    metadata_s = median_seconds(lambda: build_batch_metadata(out, engine.config.cache.block_size,
                                                                     len(runner.kv_spec.groups)), repeats=5)
    sample_s = median_seconds(lambda: runner.sampler.sample(logits, requests), repeats=5)
    for i in ids:
        engine.abort(i)
    step_s, forward_s, logits_s, matmul_s = (statistics.median(rows[k]) for k in ("step", "forward", "logits",
                                                                                  "matmuls"))
    outside = [s - f - lg for s, f, lg in zip(rows["step"], rows["forward"], rows["logits"])]
    weights = weight_bytes(model)
    kv = sum(runner.kv_spec.bytes_read(context) for context in meta.context_lens_host)
    return {
        "batch": batch,
        "context_tokens": context,
        "rounds": rounds,
        "step_ms": round(step_s * 1e3, 2),
        "matmuls_alone_ms": round(matmul_s * 1e3, 2),
        "step_over_matmuls": round(statistics.median(s / m for s, m in zip(rows["step"], rows["matmuls"])), 2),
        "step_over_matmuls_by_round": [round(s / m, 2) for s, m in zip(rows["step"], rows["matmuls"])],
        "forward_ms": round(forward_s * 1e3, 2),
        "attention_and_other_forward_ms": round(statistics.median(
            f + lg - m for f, lg, m in zip(rows["forward"], rows["logits"], rows["matmuls"])) * 1e3, 2),
        "metadata_ms": round(metadata_s * 1e3, 3),
        "sampling_ms": round(sample_s * 1e3, 3),
        "outside_forward_ms": round(statistics.median(outside) * 1e3, 2),
        "outside_forward_share": round(statistics.median(o / s for o, s in zip(outside, rows["step"])), 3),
        "output_tokens_per_s": round(batch / step_s, 1),
        "read_bandwidth_gbps": round(bandwidth / 1e9, 1),
        "matmuls_memory_floor_ms": round(weights / bandwidth * 1e3, 2),
        "step_memory_floor_ms": round((weights + kv) / bandwidth * 1e3, 2),
        "memory_floor_step_over_matmuls": round((weights + kv) / weights, 2),
        "kv_bytes": kv,
        "kv_gbps_beside_matmuls": round(kv / (step_s - matmul_s) / 1e9, 2) if step_s > matmul_s else None,
        "kv_gbps_for_twice_matmuls": round(kv / matmul_s / 1e9, 2),
    }


@torch.inference_mode()
def prefill(engine: LLMEngine, prompt_tokens: int, peak_gflops: float, repeats: int = 5, seed: int = 1,
            round_peak: Callable[[], float] | None = None) -> dict:
    """One prompt alone, prefilled in one step (distinct prompts, so the prefix cache cannot help).

    Held to the run's peak, and, where `round_peak` is given (the peak's own matmul timed again, GFLOP/s), to that
    peak as measured right after each prompt: the fraction is taken within a round, as the decode figure's ratios
    are, so that the machine's slow and fast phases do not fall on one side only."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    cfg = engine.model_config
    prompts = [_random_prompt(rng, prompt_tokens, vocab) for _ in range(repeats + 1)]

    def one_prompt() -> float:
        started = time.perf_counter()
        engine.add_request(prompts.pop(), SamplingParams(max_tokens=1, temperature=0.0))
        engine.run_to_completion()
        return time.perf_counter() - started

    one_prompt()  # warm-up
    rounds = [(one_prompt(), None if round_peak is None else round_peak()) for _ in range(repeats)]
    seconds = statistics.median(s for s, _ in rounds)
    flops = 2.0 * (prompt_tokens * cfg.layer_matmul_params + cfg.lm_head_params)
    # Causal attention: QK^T and PV over n(n+1)/2 query-key pairs per head and layer (not in the matmul count).
    attention = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt_tokens * (prompt_tokens + 1) / 2
    figures = {
        "prompt_tokens": prompt_tokens,
        "seconds": round(seconds, 3),
        "ms_by_round": [round(s * 1e3, 2) for s, _ in rounds],
        "prompt_tokens_per_s": round(prompt_tokens / seconds, 1),
        "model_gflops": round(flops / seconds / 1e9, 1),
        "fraction_of_peak": round(flops / seconds / 1e9 / peak_gflops, 3),
        "attention_gflop": round(attention / 1e9, 1),
        "with_attention_fraction_of_peak": round((flops + attention) / seconds / 1e9 / peak_gflops, 3),
    }
    if round_peak is not None:
        by_round = [flops / s / 1e9 / p for s, p in rounds]
        # Three decimals, so that each round's fraction can be checked from the reported figures on a tiny model too.
        figures |= {"round_peak_gflops_by_round": [round(p, 3) for _, p in rounds],
                    "fraction_of_round_peak": round(statistics.median(by_round), 3),
                    "fraction_of_round_peak_by_round": [round(f, 3) for f in by_round]}
    return figures


def kv_footprint(engine: LLMEngine, context: int, seed: int = 2) -> dict:
    """One request of `context` tokens alone: its prompt of `context` - 2 prefilled in budget-sized chunks, then one
    decode step, the last token sampled. The blocks it held in its largest step and in its decode step, in MiB,
    against the blocks one table for every layer would hold at `context` tokens. A sliding-window group holds its
    window plus the step's chunk, so the peak depends on the token budget too."""
    spec = engine.runner.kv_spec
    held: list[int] = []

    def observe(out: SchedulerOutput, *_) -> None:  # a step's tables are still whole after its request finished
        held.append(sum(b != NULL_BLOCK for s in out.scheduled for table in s.block_tables for b in table))

    prompt = _random_prompt(random.Random(seed), context - 2, engine.model_config.vocab_size)
    started = time.perf_counter()
    with engine.observing(observe):
        engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        engine.run_to_completion()
    one_table = -(-context // spec.block_size) * len(spec.groups)

    def mib(blocks: int) -> float:
        return round(blocks * spec.bytes_per_block / (1 << 20), 2)

    return {"context": context, "seconds": round(time.perf_counter() - started, 1),
            "kv_groups": [g.window for g in spec.groups], "block_size": spec.block_size,
            "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
            "peak_blocks": max(held), "decode_blocks": held[-1], "one_table_blocks": one_table,
            "peak_kv_mib": mib(max(held)), "decode_kv_mib": mib(held[-1]), "one_table_kv_mib": mib(one_table),
            "decode_fraction_of_one_table": round(held[-1] / one_table, 3)}


@dataclasses.dataclass
class FixedDrafts:
    """A proposer that always drafts `count` tokens (the context's last token repeated, so nearly all are
    rejected): a check costs the same whether its drafts hold or not, and every step checks as many."""

    count: int

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        return [token_ids[-1]] * min(self.count, max_drafts)


@torch.inference_mode()
def verify_steps(engine: LLMEngine, batch: int, context: int, drafts: tuple[int, ...] = (0, 1, 3, 5),
                 rounds: int = 7, seed: int = 2) -> dict:
    """For each d in `drafts`: `batch` requests of `context` random prompt tokens, past their prompts, each checking d
    drafts a step (FixedDrafts); the median of `rounds` whole steps, against d = 0's. The engine's own speculation
    settings are put back afterwards."""
    rng = random.Random(seed)
    saved = engine.config.speculative
    engine.set_speculative(SpeculativeConfig(num_speculative_tokens=max(max(drafts), 1)))
    step_ms: dict[int, float] = {}
    try:
        for d in drafts:
            engine.proposer = FixedDrafts(d)  # in place of the prompt lookup that set_speculative made
            # Room for the steps that prefill the others (the first requests decode meanwhile), then the timed ones.
            params = SamplingParams(max_tokens=128 + (rounds + 3) * (d + 1), temperature=0.0, ignore_eos=True)
            ids = _running(engine, rng, batch, context, params)
            engine.step()  # the first step whose requests all check d drafts (proposed after the step before)
            times = []
            for _ in range(rounds):
                started = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - started)
            step_ms[d] = statistics.median(times) * 1e3
            for i in ids:
                engine.abort(i)
    finally:
        engine.set_speculative(saved)
    base = step_ms.get(0)
    return {
        "batch": batch,
        "context_tokens": context,
        "rounds": rounds,
        "step_ms_by_drafts": {d: round(ms, 2) for d, ms in step_ms.items()},
        "rows_by_drafts": {d: batch * (d + 1) for d in step_ms},
        "step_over_no_drafts": {d: round(ms / base, 2) for d, ms in step_ms.items()} if base else None,
    }


@torch.inference_mode()
def prefill_interference(engine: LLMEngine, budget: int, long_prefill_chunk_tokens: int, decoding: int = 32,
                         context: int = 256, long_prompt: int = 4000, seed: int = 2) -> dict:
    """Inter-token latency of `decoding` running requests before and while a `long_prompt` prompt is prefilled.

    With chunked prefill each step carries every decode plus up to `budget - decoding` prompt tokens, or, with
    pacing on, max(long_prefill_chunk_tokens, decoding) token-equivalents of the long prompt (fewer tokens deep
    into its context): the budget and the pacing trade the long prompt's time to first token against everyone
    else's inter-token latency.
    """
    if budget <= decoding:
        raise ValueError(f"a budget of {budget} tokens leaves nothing for the prompt beside {decoding} decodes")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    engine.set_scheduler(SchedulerConfig(max_num_seqs=decoding + 1, max_num_batched_tokens=budget,
                                         long_prefill_chunk_tokens=long_prefill_chunk_tokens))
    params = SamplingParams(max_tokens=engine.max_model_len - context, temperature=0.0, ignore_eos=True)
    ids = _running(engine, rng, decoding, context, params)
    step_times: list[float] = []
    with engine.observing(lambda out, result, outputs, seconds: step_times.append(seconds)):
        for _ in range(18):  # 16 steps after 2 of warm-up: enough for a p99 that is not one unlucky step
            engine.step()
        before = step_times[2:]
        step_times.clear()
        long_id = engine.add_request(_random_prompt(rng, long_prompt, vocab), SamplingParams(max_tokens=1))
        started = time.perf_counter()
        while long_id in engine.requests:
            engine.step()
        ttft = time.perf_counter() - started
    during = step_times
    for i in ids:
        engine.abort(i)

    def p99(xs: list[float]) -> float:
        return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]

    return {
        "max_num_batched_tokens": budget,
        "long_prefill_chunk_tokens": long_prefill_chunk_tokens,
        "decoding_requests": decoding,
        "long_prompt_tokens": long_prompt,
        "itl_p99_before_ms": round(p99(before) * 1e3, 1),
        "itl_p99_during_ms": round(p99(during) * 1e3, 1),
        "itl_p99_ratio": round(p99(during) / p99(before), 2),
        "long_prompt_ttft_s": round(ttft, 2),
        "prefill_steps": len(during),
    }


def serve_memory(model: str | None, dtype: str, quantization: str, requests: int = 16) -> dict:
    """Start `loom serve`, send a burst of requests, read the process's peak resident memory (VmHWM)."""
    port = free_loopback_port()
    cmd = [sys.executable, "-m", "loom.cli", "serve", "--port", str(port), "--dtype", dtype,
           "--quantization", quantization]
    if model:
        cmd.insert(4, model)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, timeout=180)
        idle_kib = _vm_hwm_kib(proc.pid)

        def one(i: int) -> None:
            httpx.post(base + "/v1/completions", json={"prompt": f"Request {i}: tell me a story.", "max_tokens": 64,
                                                       "ignore_eos": True}, timeout=300)

        with ThreadPoolExecutor(requests) as pool:
            list(pool.map(one, range(requests)))
        return {"dtype": dtype, "quantization": quantization, "requests": requests,
                "peak_rss_mib_after_start": round(idle_kib / 1024), "peak_rss_mib": round(_vm_hwm_kib(proc.pid) / 1024)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _vm_hwm_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc status")


def main(args: argparse.Namespace) -> int:
    loaded: LoadedModel = load_model(args.model)
    figures = set(args.figures.split(","))
    quantizations = args.quantizations.split(",")
    for dtype, quantization in itertools.product(args.dtypes.split(","), quantizations):
        config = engine_config(args, dtype, quantization)
        engine = LLMEngine(config, loaded)
        backend = matmul_backend_name(engine.runner.model)
        base = {"dtype": dtype, "quantization": quantization, "threads": torch.get_num_threads(),
                "attention_backend": type(engine.runner.attention).__name__, "matmul_backend": backend,
                "layer_ops": layer_ops_name(engine.runner.model), "kv_cache_dtype": args.kv_cache_dtype}
        models = {backend: engine.runner.model}
        twin = dense_twin(loaded, engine)
        if twin is not None:
            models[matmul_backend_name(twin)] = twin
        if backend != "torch":
            models["torch"] = loaded.build(engine.config.dtype, make_matmul("torch"))
        peaks = {name: matmul_peak(model) for name, model in models.items()}
        best = max(peaks, key=lambda name: peaks[name]["peak_gflops"])
        peak = {"peak_gflops": peaks[best]["peak_gflops"], "peak_backend": best, "by_backend": peaks}
        if "peak" in figures:
            emit({"figure": "matmul_peak", **base, **peak})
        if "decode" in figures:
            bandwidth = read_bandwidth()
            for batch in (int(b) for b in args.decode_batches.split(",")):
                emit({"figure": "decode", **base, **decode_step(engine, batch, args.context, bandwidth)})
        if "prefill" in figures:
            emit({"figure": "prefill", **base, **prefill(
                engine, args.prefill_tokens, peak["peak_gflops"],
                round_peak=lambda: shape_gflops(models[best], *peaks[best]["peak_rows_shape"]))})
        if "verify" in figures:
            drafts = tuple(int(d) for d in args.verify_drafts.split(","))
            emit({"figure": "verify", **base, **verify_steps(engine, args.verify_batch, args.context, drafts)})
        if "interference" in figures:
            for budget in (int(b) for b in args.interference_budgets.split(",")):
                for pacing in (int(c) for c in args.interference_pacing.split(",")):
                    emit({"figure": "prefill_interference", **base, **prefill_interference(engine, budget, pacing)})
        if "memory" in figures:
            emit({"figure": "serve_memory", **serve_memory(args.model, dtype, quantization)})
        if "kv" in figures:
            for context in (int(c) for c in args.kv_contexts.split(",")):
                emit({"figure": "kv_footprint", **base, **kv_footprint(engine, context)})
    if "agreement" in figures:
        for quantization in quantizations:
            emit({"figure": "agreement", "quantization": quantization, "attention_backend": args.attention_backend,
                  "matmul_backend": args.matmul_backend, "layer_ops": args.layer_ops,
                  "kv_cache_dtype": args.kv_cache_dtype,
                  **dtype_agreement(loaded, args.agreement_requests, engine_config(args, "float32", quantization))})
    return 0


def engine_config(args: argparse.Namespace, dtype: str, quantization: str) -> EngineConfig:
    """The engine every figure runs on: the command line's backends and threads, room for the longest prefill."""
    return EngineConfig(
        dtype=dtype, num_threads=args.threads, attention_backend=args.attention_backend,
        matmul_backend=args.matmul_backend, quantization=quantization, layer_ops=args.layer_ops,
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max(2048, args.prefill_tokens)),
        cache=CacheConfig(kv_cache_memory=int(args.kv_cache_memory * (1 << 30)), enable_prefix_caching=False,
                          kv_cache_dtype=args.kv_cache_dtype),
    )


def dtype_agreement(loaded: LoadedModel, num_requests: int, config: EngineConfig) -> dict:
    """Share of positions where bf16 and fp32 greedy outputs agree, and of requests identical throughout.

    Both runs use `config` (backends, quantization, threads) but for the dtype, so a flag such as
    --attention-backend reference shows whether a kernel moves the agreement. The float32 run, the reference,
    keeps its own-dtype KV cache: an int8 cache in `config` is measured in the bfloat16 run alone."""
    requests = mixed_workload(loaded.tokenizer, num_requests)
    outputs = {}
    reference_cache = dataclasses.replace(config.cache, kv_cache_dtype="auto")
    for dtype, cache in (("float32", reference_cache), ("bfloat16", config.cache)):
        engine = LLMEngine(dataclasses.replace(config, dtype=dtype, cache=cache), loaded)
        _, outputs[dtype], _ = run_once(engine, requests, "continuous", num_requests, 512)
    same_positions = total = identical = prefix = 0
    for a, b in zip(outputs["float32"], outputs["bfloat16"]):
        same_positions += sum(x == y for x, y in zip(a, b))
        total += len(a)
        identical += a == b
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return {"requests": num_requests, "tokens": total, "position_agreement": round(same_positions / total, 4),
            "tokens_before_first_divergence": round(prefix / total, 4), "identical_requests": identical}
