"""`loom bench offline`: static vs continuous batching on the same engine, float32 and bfloat16, JSON lines.

Each run prints one JSON object; a final line per workload and dtype gives the continuous/static ratio and
whether both policies produced identical greedy tokens (they must).
"""

from __future__ import annotations

import argparse
import json
import time

from loom.bench.workloads import BenchRequest, article_workload, mixed_workload
from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.engine.engine import LLMEngine
from loom.model.loader import load_model
from loom.sampling import SamplingParams


def run_once(engine: LLMEngine, requests: list[BenchRequest], policy: str, max_num_seqs: int,
             max_num_batched_tokens: int) -> tuple[dict, list[list[int]]]:
    engine.set_scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, policy))
    steps = pad = prompt_tokens = 0

    def observe(out, result, outputs, seconds):
        nonlocal steps, pad, prompt_tokens
        steps += 1
        pad += out.num_pad_tokens
        prompt_tokens += out.num_prefill_tokens

    started = time.perf_counter()
    ids = [
        engine.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
        for r in requests
    ]
    done = {}
    with engine.observing(observe):
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
    seconds = time.perf_counter() - started
    outputs = [done[i] for i in ids]
    out_tokens = sum(len(o.token_ids) for o in outputs)
    assert all(len(o.token_ids) == r.max_tokens for o, r in zip(outputs, requests)), "ignore_eos run cut short"
    ttfts = sorted(o.metrics.ttft for o in outputs)
    return {
        "policy": policy,
        "seconds": round(seconds, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / seconds, 2),
        "prefill_tokens": prompt_tokens,
        "pad_tokens": pad,
        "steps": steps,
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
        "preemptions": engine.scheduler.num_preemptions,
    }, [o.token_ids for o in outputs]


def main(args: argparse.Namespace) -> int:
    loaded = load_model(args.model)
    workloads = {"article": (article_workload(), 3), "mixed": (
        mixed_workload(loaded.tokenizer, args.num_requests, seed=args.seed), args.max_num_seqs)}
    names = list(workloads) if args.workload == "all" else [args.workload]
    ok = True
    for dtype in args.dtypes.split(","):
        engine = LLMEngine(EngineConfig(dtype=dtype, num_threads=args.threads,
                                        cache=CacheConfig(num_kv_blocks=args.num_kv_blocks)), loaded)
        for name in names:
            requests, seqs = workloads[name]
            results, tokens = {}, {}
            for policy in args.policies.split(","):
                results[policy], tokens[policy] = run_once(engine, requests, policy, seqs, args.max_num_batched_tokens)
                print(json.dumps({"workload": name, "dtype": dtype, "requests": len(requests), "max_num_seqs": seqs,
                                  **results[policy]}), flush=True)
            if {"static", "continuous"} <= set(results):
                same = tokens["static"] == tokens["continuous"]
                ok &= same
                print(json.dumps({
                    "workload": name, "dtype": dtype, "summary": True,
                    "continuous_over_static_tokens_per_s": round(
                        results["continuous"]["output_tokens_per_s"] / results["static"]["output_tokens_per_s"], 3),
                    "static_pad_fraction": round(results["static"]["pad_tokens"] / (
                        results["static"]["pad_tokens"] + results["static"]["prefill_tokens"]
                        + results["static"]["output_tokens"]), 3),
                    "identical_outputs": same,
                }), flush=True)
    return 0 if ok else 1
