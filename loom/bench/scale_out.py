"""`loom bench serve --scale-out`: the same workloads through one `loom serve` and through `loom serve --replicas N`
with each router, every server started here in turn with the same engine options.

Two workloads: tenants (each tenant's requests share its own long system prompt, arriving interleaved), where the
figure is the prefix cache's hit rate beside throughput and TTFT; and mixed, on the single engine and the first
router only, where the figure is what the extra processes cost. Hit rates and routing counts come from the server's
/metrics; memory is the proportional set size of the server and every process under it (Ray's included). Client,
server and replicas share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from loom.bench.local_server import descendants, local_server
from loom.bench.serve_client import run_benchmark
from loom.bench.stats import summarize
from loom.bench.workloads import BenchRequest, mixed_workload, tenants_workload
from loom.engine_args import engine_flags
from loom.model.loader import load_model


@dataclass
class System:
    """One way to serve: a name for the tables and the `loom serve` flags that make it."""

    name: str
    router: str | None
    flags: list[str]


def systems(args: argparse.Namespace) -> list[System]:
    cores = os.cpu_count() or 1
    single = System(f"1 engine x {cores} threads", None, ["--threads", str(cores)])
    threads = max(1, cores // args.replicas)
    return [single, *(System(f"{args.replicas} replicas x {threads} thread(s), router {router}", router,
                             ["--replicas", str(args.replicas), "--threads-per-replica", str(threads),
                              "--router", router])
                      for router in args.routers.split(","))]


def tree_pss_gib(pid: int) -> float:
    """Proportional set size of `pid` and every process under it (shared pages counted once in all)."""
    kib = 0
    for process in descendants(pid):
        try:
            for line in Path(f"/proc/{process}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    kib += int(line.split()[1])
        except OSError:
            pass
    return kib / (1 << 20)


def scrape(base: str) -> dict[str, float]:
    """Prefix-cache lookups and hits summed over replicas, and routed requests by reason and by replica."""
    totals: dict[str, float] = {}
    text = httpx.get(base + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("loom_prefix_cache_queries", "loom_prefix_cache_hits"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            elif sample.name == "loom_router_requests_total":
                for key in (f"routed_by:{sample.labels['routed_by']}", f"replica:{sample.labels['replica']}"):
                    totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def measure(base: str, requests: list[BenchRequest], concurrency: int, seed: int) -> dict:
    """One workload's throughput and latencies, and what the server's counters moved by meanwhile."""
    time.sleep(1.5)  # replicas post their metrics every second
    before = scrape(base)
    records, duration = asyncio.run(run_benchmark(base, requests, concurrency, seed=seed))
    time.sleep(1.5)
    after = scrape(base)
    moved = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    summary = summarize(records, duration)
    queries = moved.get("loom_prefix_cache_queries", 0.0)
    return {"completed": summary["completed"], "failed": summary["failed"], "duration_s": round(duration, 2),
            "output_token_throughput": round(summary["output_token_throughput"], 1),
            "ttft_ms": {k: summary["ttft_ms"][k] and round(summary["ttft_ms"][k], 1) for k in ("median", "p99")},
            "tpot_ms": {k: summary["tpot_ms"][k] and round(summary["tpot_ms"][k], 2) for k in ("median", "p99")},
            "prefix_cache_hit_rate": round(moved.get("loom_prefix_cache_hits", 0.0) / queries, 4) if queries else None,
            "routed_by": {k.split(":", 1)[1]: int(v) for k, v in moved.items() if k.startswith("routed_by:") and v},
            "requests_per_replica": sorted((int(v) for k, v in moved.items() if k.startswith("replica:") and v),
                                           reverse=True),
            "errors": sorted({r.error for r in records if r.error})[:3]}


def run(args: argparse.Namespace) -> list[dict]:
    concurrency = int(str(args.concurrency or "32").split(",")[0])
    tokenizer = load_model(args.serve_model).tokenizer
    workloads = {"tenants": tenants_workload(tokenizer, args.tenants, args.system_tokens, args.num_requests,
                                             tuple(args.output_len), args.seed),
                 "mixed": mixed_workload(tokenizer, args.num_requests, tuple(args.prompt_len),
                                         tuple(args.output_len), seed=args.seed)}
    rows = []
    for index, system in enumerate(systems(args)):
        with local_server(args.serve_model, [*engine_flags(args), *system.flags]) as (base, server, startup_s):
            asyncio.run(run_benchmark(base, [BenchRequest("Hello", 4)], 1))  # the first request, untimed
            names = ["tenants", "mixed"] if index < 2 else ["tenants"]  # mixed: one engine and the first router
            for name in names:
                rows.append({"system": system.name, "router": system.router, "workload": name,
                             "requests": len(workloads[name]), "concurrency": concurrency,
                             "startup_s": round(startup_s, 1),
                             **measure(base, workloads[name], concurrency, args.seed)})
            memory = round(tree_pss_gib(server.pid), 2)
            for row in rows:
                row.setdefault("memory_gib", memory)
    single = next(r["prefix_cache_hit_rate"] for r in rows if r["router"] is None and r["workload"] == "tenants")
    for row in rows:
        if row["workload"] == "tenants" and row["router"] and single:
            row["hit_rate_of_single"] = round(row["prefix_cache_hit_rate"] / single, 3)
    return rows


def summary_line(row: dict) -> str:
    hit = "" if row["prefix_cache_hit_rate"] is None else f", prefix hits {100 * row['prefix_cache_hit_rate']:.1f}%"
    of_single = f" ({100 * row['hit_rate_of_single']:.1f}% of one engine's)" if "hit_rate_of_single" in row else ""
    routed = f", routed {row['routed_by']} per replica {row['requests_per_replica']}" if row["routed_by"] else ""
    return (f"{row['workload']:8} {row['system']}: {row['output_token_throughput']:.1f} tok/s, TTFT p50/p99 "
            f"{row['ttft_ms']['median']:.0f}/{row['ttft_ms']['p99']:.0f} ms{hit}{of_single}{routed}; "
            f"up in {row['startup_s']:.0f} s, {row['memory_gib']:.2f} GiB")


def main(args: argparse.Namespace) -> int:
    rows = run(args)
    for row in rows:
        print(json.dumps(row))
    for row in rows:
        Console(stderr=True).print(summary_line(row), markup=False)
    return 0 if all(not row["errors"] for row in rows) else 1
