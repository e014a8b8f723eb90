"""`loom bench offline`: engines side by side on one workload in one process, one JSON line per run.

Loom static vs Loom continuous (per dtype) on the same engine; optionally Hugging Face transformers as the peer
(static `generate` waves and its own `generate_batch`) on the first `--hf-requests` requests, next to Loom
continuous on that same subset; optionally a sweep of one scheduler limit, and speculation settings run in turn
for several rounds (each one's median against the first's). Greedy outputs must agree (with drafts: in float32).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from loom.bench.matmul_timing import dense_twin, matmul_backend_name, matmul_peak
from loom.bench.memory_roofline import read_bandwidth, run_roofline, weight_bytes
from loom.bench.workloads import BenchRequest, article_workload, mixed_workload, shared_prefix_workload
from loom.config import SchedulerConfig
from loom.engine.engine import LLMEngine
from loom.engine.trace import StepTracer
from loom.engine_args import engine_config
from loom.model.loader import load_model
from loom.sampling import SamplingParams


def run_once(engine: LLMEngine, requests: list[BenchRequest], policy: str, max_num_seqs: int,
             max_num_batched_tokens: int) -> tuple[dict, list[list[int]], StepTracer]:
    """Every request greedy with ignore_eos (so each generates exactly max_tokens), timed end to end."""
    pacing = engine.config.scheduler.long_prefill_chunk_tokens  # as --long-prefill-chunk-tokens set it
    engine.set_scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, policy, pacing))
    engine.pool.reset_prefix_cache()  # every run starts cold, whatever ran before it on this engine
    tracer = StepTracer(engine)
    drafts_before, accepted_before = engine.num_draft_tokens, engine.num_accepted_tokens
    started = time.perf_counter()
    ids = [
        engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
        for r in requests
    ]
    with engine.observing(tracer):
        done = engine.run_to_completion()
    seconds = time.perf_counter() - started
    outputs = [done[i] for i in ids]
    out_tokens = sum(len(o.token_ids) for o in outputs)
    if any(len(o.token_ids) != r.max_tokens for o, r in zip(outputs, requests)):
        raise RuntimeError("an ignore_eos request returned fewer tokens than asked")
    ttfts = sorted(o.metrics.ttft for o in outputs)
    records = tracer.records
    cfg, block_size = engine.model_config, engine.config.cache.block_size
    computed = sum(r.prefill_tokens + r.decode_tokens + r.pad_tokens for r in records)
    flops = 2.0 * (computed * cfg.layer_matmul_params + out_tokens * cfg.lm_head_params)
    held = [(r.blocks_used * block_size, r.tokens_in_cache) for r in records if r.blocks_used]
    return {
        "system": f"loom-{policy}",
        "seconds": round(seconds, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / seconds, 2),
        "prefill_tokens": sum(r.prefill_tokens for r in records),
        "pad_tokens": sum(r.pad_tokens for r in records),
        "steps": len(records),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
        "peak_kv_blocks_used": max((r.blocks_used for r in records), default=0),
        # Three decimals: a tiny test model's few MFLOP/s must not round to zero on a loaded machine.
        "model_gflops": round(flops / seconds / 1e9, 3),
        # KV slots allocated but holding no token (the unfilled tail of each request's last block), over all steps.
        "kv_fragmentation": round(1 - sum(t for _, t in held) / max(1, sum(s for s, _ in held)), 4),
        "prefix_cache_hit_tokens": engine.scheduler.prefix_cache_hits,
        "prefix_caching": engine.config.cache.enable_prefix_caching and policy == "continuous",
        # Speculation: decode_tokens (and so model_gflops) count every draft, the rejected ones too.
        "spec_draft_tokens": engine.num_draft_tokens - drafts_before,
        "spec_accepted_tokens": engine.num_accepted_tokens - accepted_before,
    }, [o.token_ids for o in outputs], tracer


def roofline_figures(engine: LLMEngine, tracer: StepTracer, line: dict, peak_gflops: float,
                     bandwidth: float) -> dict:
    """The run against its roofline on this machine (memory_roofline.py): the time its steps' FLOPs and bytes
    allow at the measured peak and read bandwidth, how far the run is from it, and the fraction of the matmul peak
    that the roofline itself allows."""
    cfg = engine.model_config
    spec = engine.runner.kv_spec
    roofline = run_roofline(tracer.records, cfg.layer_matmul_params, cfg.lm_head_params,
                            weight_bytes(engine.runner.model), spec.bytes_per_slot, spec.bytes_per_token,
                            peak_gflops * 1e9, bandwidth)
    seconds = roofline["roofline_seconds"]
    return {
        "read_bandwidth_gbps": round(bandwidth / 1e9, 1),
        "roofline_seconds": round(seconds, 4),
        "roofline_compute_seconds": round(roofline["roofline_compute_seconds"], 4),  # every step at the peak
        "roofline_memory_seconds": round(roofline["roofline_memory_seconds"], 4),  # every step at the bandwidth
        "roofline_memory_bound_step_share": round(roofline["memory_bound_step_share"], 3),
        "seconds_over_roofline": round(line["seconds"] / seconds, 2),
        "roofline_fraction_of_peak": round(roofline["matmul_flops"] / seconds / (peak_gflops * 1e9), 3),
    }


def emit(line: dict) -> None:
    """One result as one JSON line on stdout."""
    print(json.dumps(line), flush=True)


def _hf_peer(args, loaded, requests: list[BenchRequest], max_num_seqs: int, engine: LLMEngine, name: str,
             peak_gflops: float, bandwidth: float) -> bool:
    """transformers on the first requests, in the engine's dtype, against Loom on the same requests. In float32 both
    must give the same tokens (False if not); in bfloat16 torch's matmul sums in another order, so tokens may part,
    and that is reported, not failed.

    Beside each ratio, the ratio's ceiling: the peer's time over Loom's memory floor on the same requests (every
    step of the subset's run reading its weights and K/V once at the measured read bandwidth, nothing else costing
    anything), the most that Loom, holding the weights as it does, could be over the peer on this machine."""
    from loom.bench.hf_peer import hf_continuous, hf_static, load_hf_model

    subset = requests[: args.hf_requests]
    prompts = [r.prompt if isinstance(r.prompt, list) else loaded.tokenizer.encode(r.prompt) for r in subset]
    loom_line, loom_tokens, tracer = run_once(engine, subset, "continuous", max_num_seqs, args.max_num_batched_tokens)
    roofline = roofline_figures(engine, tracer, loom_line, peak_gflops, bandwidth)
    floor = roofline["roofline_memory_seconds"]
    dtype = engine.config.dtype
    exact = dtype == torch.float32
    base = {"workload": name, "dtype": str(dtype).removeprefix("torch."), "requests": len(subset),
            "max_num_seqs": max_num_seqs}
    emit({**base, **loom_line, **roofline, "system": "loom-continuous(subset)"})
    model = load_hf_model(args.model, dtype)
    pad = loaded.tokenizer.eos_token_ids[0] if loaded.tokenizer.eos_token_ids else 0
    ok = True
    seconds, tokens = hf_static(model, prompts, subset, max_num_seqs, pad)
    useful = sum(r.max_tokens for r in subset)
    emit({**base, "system": "hf-generate-static", "seconds": round(seconds, 3), "output_tokens": useful,
           "output_tokens_per_s": round(useful / seconds, 2),
           "loom_continuous_over_this": round(loom_line["output_tokens_per_s"] * seconds / useful, 3),
           "loom_memory_floor_over_this": round(seconds / floor, 3),
           "identical_outputs_to_loom": tokens == loom_tokens})
    ok &= tokens == loom_tokens or not exact
    try:
        seconds, tokens, generated = hf_continuous(model, prompts, subset)
    except Exception as e:  # generate_batch is new and version-dependent: report, do not crash the run
        emit({**base, "system": "hf-generate-batch", "error": f"{type(e).__name__}: {e}"})
        return ok
    emit({**base, "system": "hf-generate-batch", "seconds": round(seconds, 3), "output_tokens": useful,
           "generated_tokens": generated, "output_tokens_per_s": round(useful / seconds, 2),
           "generated_tokens_per_s": round(generated / seconds, 2),
           "loom_continuous_over_this": round(loom_line["output_tokens_per_s"] * seconds / useful, 3),
           "loom_memory_floor_over_this": round(seconds / floor, 3),
           "identical_outputs_to_loom": tokens == loom_tokens})
    return ok & (tokens == loom_tokens or not exact)


def _speculative_runs(args: argparse.Namespace, engine: LLMEngine, requests: list[BenchRequest], seqs: int,
                      base: dict) -> bool:
    """Each of --speculative-configs (None: one token a step) with the continuous policy, --rounds times in turn, so
    that the VM's drift falls on all of them alike; then each one's median tok/s against the first's. In float32
    drafts change no greedy output (False if they do); in bfloat16 a check runs other kernels than a decode, so
    tokens may part, and that is reported, not failed."""
    configs = args.speculative_configs
    original = engine.config.speculative
    rates: list[list[float]] = [[] for _ in configs]
    tokens: list[list[list[int]]] = [[] for _ in configs]
    described = [dataclasses.asdict(c) if c is not None else None for c in configs]
    for round_index in range(args.rounds):
        for i, config in enumerate(configs):
            engine.set_speculative(config)
            line, tokens[i], _ = run_once(engine, requests, "continuous", seqs, args.max_num_batched_tokens)
            rates[i].append(line["output_tokens_per_s"])
            emit({**base, "speculative_config": described[i], "round": round_index, **line})
    engine.set_speculative(original)
    first = statistics.median(rates[0])
    ok = True
    for description, rate, outputs in zip(described, rates, tokens):
        same = outputs == tokens[0]
        ok &= same or engine.config.dtype != torch.float32
        emit({**base, "summary": True, "speculative_config": description, "rounds": args.rounds,
              "output_tokens_per_s_by_round": rate, "output_tokens_per_s_median": round(statistics.median(rate), 2),
              "over_first": round(statistics.median(rate) / first, 3), "identical_outputs_to_first": same})
    return ok


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    loaded = load_model(args.model)
    # Built only when asked for: the shared-prefix workload needs a chat template that a model may not have.
    build_workload = {
        "article": lambda: (article_workload(), 3),
        "mixed": lambda: (mixed_workload(loaded.tokenizer, args.num_requests, seed=args.seed), args.max_num_seqs),
        "shared-prefix": lambda: (shared_prefix_workload(loaded.tokenizer, args.num_requests, seed=args.seed),
                                  args.max_num_seqs),
    }
    names = ["article", "mixed"] if args.workload == "all" else [args.workload]
    workloads = {name: build_workload[name]() for name in names}
    plot_dir = Path(args.plot) if args.plot else None
    ok = True
    quantizations = args.quantizations.split(",")
    for dtype, quantization in itertools.product(args.dtypes.split(","), quantizations):
        engine = LLMEngine(engine_config(args, dtype, quantization), loaded)
        label = dtype if quantization == "none" else f"{dtype}-{quantization}"  # in file names and titles
        # The roofline each run is held to: the best matmul FLOP/s on the model's own shapes (and, for GGUF blocks,
        # on the same weights dense), in this process, measured before and after the run (this VM's speed drifts by
        # tens of percent from minute to minute); the higher of the two, so the fraction errs low. One run's "after"
        # is the next one's "before".
        peak_models = [m for m in (engine.runner.model, dense_twin(loaded, engine)) if m is not None]

        def measured_peak() -> float:
            return max(matmul_peak(m)["peak_gflops"] for m in peak_models)

        before = measured_peak()
        bandwidth_before = read_bandwidth()  # the same before-and-after rule for the memory side of the roofline
        for name in names:
            requests, seqs = workloads[name]
            results, tokens, traces = {}, {}, {}  # traces: policy -> StepTracer
            base = {"workload": name, "dtype": dtype, "quantization": quantization,
                    "matmul_backend": matmul_backend_name(engine.runner.model), "requests": len(requests),
                    "max_num_seqs": seqs}
            for policy in args.policies.split(","):
                results[policy], tokens[policy], traces[policy] = run_once(
                    engine, requests, policy, seqs, args.max_num_batched_tokens)
                after = measured_peak()
                bandwidth_after = read_bandwidth()
                peak, bandwidth = max(before, after), max(bandwidth_before, bandwidth_after)
                emit({**base, "matmul_peak_gflops": peak, "matmul_peak_before_after_gflops": [before, after],
                      **results[policy], "fraction_of_peak": round(results[policy]["model_gflops"] / peak, 3),
                      **roofline_figures(engine, traces[policy], results[policy], peak, bandwidth)})
                before, bandwidth_before = after, bandwidth_after
                if args.trace:
                    traces[policy].save_chrome_trace(Path(args.trace) / f"{name}-{label}-{policy}.json")
            if {"static", "continuous"} <= set(results):
                same = tokens["static"] == tokens["continuous"]
                ok &= same
                st = results["static"]
                emit({**base, "summary": True,
                       "continuous_over_static": round(results["continuous"]["output_tokens_per_s"]
                                                       / st["output_tokens_per_s"], 3),
                       "static_pad_fraction": round(st["pad_tokens"] / (st["pad_tokens"] + st["prefill_tokens"]
                                                                        + st["output_tokens"]), 3),
                       "identical_outputs": same})
            if plot_dir is not None and traces:
                from loom.bench.plots import kv_usage, slot_timeline

                records = {policy: t.records for policy, t in traces.items()}
                slot_timeline(records, seqs, plot_dir / f"timeline-{name}-{label}.png", f"{name} workload, {label}")
                kv_usage(records, plot_dir / f"kv-{name}-{label}.png")
            if args.peers == "hf" and quantization == quantizations[0]:
                ok &= _hf_peer(args, loaded, requests, seqs, engine, name, before, bandwidth_before)
            if args.speculative_configs:
                ok &= _speculative_runs(args, engine, requests, seqs, base)
        if args.sweep:
            key, values = args.sweep.split("=")
            if key not in ("max_num_seqs", "max_num_batched_tokens"):
                raise ValueError(f"--sweep takes max_num_seqs=... or max_num_batched_tokens=..., got {key!r}")
            xs = [int(v) for v in values.split(",")]
            requests, seqs = workloads[names[-1]]
            throughput = []
            for x in xs:
                limits = {"max_num_seqs": seqs, "max_num_batched_tokens": args.max_num_batched_tokens, key: x}
                line, _, _ = run_once(engine, requests, "continuous", limits["max_num_seqs"],
                                      limits["max_num_batched_tokens"])
                throughput.append(line["output_tokens_per_s"])
                emit({"workload": names[-1], "dtype": dtype, "quantization": quantization, "sweep": key, key: x,
                      **line})
            if plot_dir is not None:
                from loom.bench.plots import throughput_vs

                throughput_vs(xs, {f"loom continuous ({label})": throughput}, key, "output tokens/s",
                              plot_dir / f"sweep-{key}-{label}.png", f"throughput vs {key}")
    return 0 if ok else 1
