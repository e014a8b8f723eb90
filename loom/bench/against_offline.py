"""`loom bench serve --against-offline`: one workload offline (`LLMEngine` in this process), then through a
`loom serve` this command starts with the same engine settings, at each concurrency; the ratios side by side.

At concurrency 1 each request runs alone (offline: one request at a time on the engine; online: one client), and the
figure is the time per output token after the first. At higher concurrencies the offline engine runs the whole
workload with `max_num_seqs` = that concurrency, as that many clients keep that many requests in flight; the figure
is output tokens per second. Client and server share this machine's cores: the client's own CPU time and the
server's are reported beside every online figure.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import time
from pathlib import Path

from rich.console import Console

from loom.bench.local_server import local_server
from loom.bench.openmp_census import parked_openmp_workers
from loom.bench.serve_client import run_benchmark
from loom.bench.stats import distribution, summarize
from loom.bench.workloads import BenchRequest, mixed_workload
from loom.config import SchedulerConfig
from loom.engine.async_engine import ENGINE_THREAD_NAME
from loom.engine.engine import LLMEngine
from loom.engine_args import engine_config, engine_flags
from loom.model.loader import load_model
from loom.sampling import SamplingParams


def _greedy(request: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)


def offline_single_stream(engine: LLMEngine, requests: list[BenchRequest]) -> dict:
    """Each request alone: its time per output token after the first, and its time to first token."""
    tpots, ttfts, tokens, seconds = [], [], 0, 0.0
    for request in requests:
        started = time.perf_counter()
        engine.add_request(request.prompt, _greedy(request))
        output = next(iter(engine.run_to_completion().values()))
        seconds += time.perf_counter() - started
        metrics, n = output.metrics, len(output.token_ids)
        tokens += n
        ttfts.append(metrics.ttft)
        if n > 1:
            tpots.append((metrics.finish_time - metrics.first_token_time) / (n - 1))
    return {"output_token_throughput": tokens / seconds, "tpot_ms": distribution(tpots),
            "ttft_ms": distribution(ttfts)}


def offline_concurrent(engine: LLMEngine, requests: list[BenchRequest], concurrency: int) -> dict:
    """The whole workload with at most `concurrency` requests running: output tokens per second."""
    scheduler = engine.config.scheduler
    engine.set_scheduler(SchedulerConfig(concurrency, scheduler.max_num_batched_tokens, scheduler.policy,
                                         scheduler.long_prefill_chunk_tokens))
    started = time.perf_counter()
    for request in requests:
        engine.add_request(request.prompt, _greedy(request))
    outputs = engine.run_to_completion().values()
    seconds = time.perf_counter() - started
    return {"output_token_throughput": sum(len(o.token_ids) for o in outputs) / seconds, "seconds": seconds}


def _cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _engine_and_other_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds of the server's engine thread and its OpenMP workers (named ENGINE_THREAD_NAME), and of every
    other thread (the event loop, the request-making workers, uvicorn), live threads only."""
    engine = other = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            seconds, name = _cpu_seconds(task / "stat"), (task / "comm").read_text().strip()
        except OSError:
            continue
        if name == ENGINE_THREAD_NAME:
            engine += seconds
        else:
            other += seconds
    return engine, other


def _requests_at(requests: list[BenchRequest], concurrency: int, single_stream_requests: int) -> list[BenchRequest]:
    return requests[:single_stream_requests] if concurrency == 1 else requests


def run(args: argparse.Namespace) -> list[dict]:
    levels = [int(c) for c in str(args.concurrency or "1,64").split(",")]
    loaded = load_model(args.serve_model)
    requests = mixed_workload(loaded.tokenizer, args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                              seed=args.seed)
    args.max_num_seqs = max(levels)
    engine = LLMEngine(engine_config(args), loaded)
    engine.warm_up()
    offline = {}
    for level in levels:
        chosen = _requests_at(requests, level, args.single_stream_requests)
        offline[level] = (offline_single_stream(engine, chosen) if level == 1
                          else offline_concurrent(engine, chosen, level))
    dtype = str(engine.config.dtype).removeprefix("torch.")
    del engine, loaded
    gc.collect()

    rows = []
    with local_server(args.serve_model, engine_flags(args)) as (base, server, _):
        asyncio.run(run_benchmark(base, requests[:1], 1))  # the server's first request, untimed
        for level in levels:
            chosen = _requests_at(requests, level, args.single_stream_requests)
            client_before, server_before = time.process_time(), _engine_and_other_cpu_seconds(server.pid)
            records, duration = asyncio.run(run_benchmark(base, chosen, level, seed=args.seed))
            client_cpu = time.process_time() - client_before
            engine_cpu, other_cpu = (after - before for after, before in
                                     zip(_engine_and_other_cpu_seconds(server.pid), server_before))
            online = summarize(records, duration)
            if level == 1:
                ratio = {"tpot_online_over_offline": online["tpot_ms"]["median"] / offline[level]["tpot_ms"]["median"]}
            else:
                ratio = {"throughput_online_over_offline":
                         online["output_token_throughput"] / offline[level]["output_token_throughput"]}
            rows.append({"concurrency": level, "requests": len(chosen), "dtype": dtype, "offline": offline[level],
                         "online": {key: online[key] for key in ("completed", "failed", "duration_s",
                                                                 "output_token_throughput", "ttft_ms", "tpot_ms",
                                                                 "itl_ms")},
                         **{key: round(value, 3) for key, value in ratio.items()},
                         "client_cpu_s": round(client_cpu, 2), "server_cpu_s": round(engine_cpu + other_cpu, 2),
                         "server_engine_threads_cpu_s": round(engine_cpu, 2),
                         "server_other_threads_cpu_s": round(other_cpu, 2),
                         "errors": sorted({r.error for r in records if r.error})[:3]})
        workers = parked_openmp_workers(server.pid)  # once, after the last level: it waits for idle workers
        for row in rows:
            row["server_openmp_workers"] = workers
    return rows


def summary_line(row: dict) -> str:
    """One line a person reads: the concurrency, the offline and online figures and their ratio."""
    if row["concurrency"] == 1:
        offline, online = row["offline"]["tpot_ms"]["median"], row["online"]["tpot_ms"]["median"]
        return (f"1 stream: {offline:.2f} ms/token offline, {online:.2f} online "
                f"({row['tpot_online_over_offline']:.3f}x); TTFT p99 {row['online']['ttft_ms']['p99']:.0f} ms")
    offline, online = row["offline"]["output_token_throughput"], row["online"]["output_token_throughput"]
    return (f"{row['concurrency']} clients: {offline:.1f} tok/s offline, {online:.1f} online "
            f"({row['throughput_online_over_offline']:.3f}x); TTFT p50/p99 {row['online']['ttft_ms']['median']:.0f}/"
            f"{row['online']['ttft_ms']['p99']:.0f} ms; CPU s over {row['online']['duration_s']:.1f} s: client "
            f"{row['client_cpu_s']:.1f}, server engine threads {row['server_engine_threads_cpu_s']:.1f}, other "
            f"server threads {row['server_other_threads_cpu_s']:.1f}")


def plot(rows: list[dict], directory: str) -> None:
    """Throughput offline and online, and the online latencies, against the number of clients."""
    from loom.bench.plots import throughput_vs

    xs = [row["concurrency"] for row in rows]
    throughput_vs(xs, {"offline (LLMEngine)": [row["offline"]["output_token_throughput"] for row in rows],
                       "online (loom serve)": [row["online"]["output_token_throughput"] for row in rows]},
                  "concurrent clients", "output tokens/s", f"{directory}/serve_throughput.png",
                  f"throughput against load, {rows[0]['dtype']}")
    latency = {f"{name} {stat}": [row["online"][f"{name}_ms"][stat] or 0.0 for row in rows]
               for name in ("ttft", "tpot") for stat in ("median", "p99")}
    throughput_vs(xs, latency, "concurrent clients", "ms", f"{directory}/serve_latency.png",
                  "TTFT and time per output token against load (loom serve)")


def main(args: argparse.Namespace) -> int:
    rows = run(args)
    for row in rows:
        print(json.dumps(row))
    for row in rows:
        Console(stderr=True).print(summary_line(row))
    if args.plot:
        plot(rows, args.plot)
    return 0 if all(not row["errors"] for row in rows) else 1
