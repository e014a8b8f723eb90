"""`loom bench serve`: an online benchmark client for any OpenAI-compatible server (Loom, llama-server, vLLM).

Requests stream from /v1/completions with `ignore_eos`, arriving at a fixed concurrency or as a seeded Poisson
process; every request must return exactly the tokens it asked for (checked through the usage chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from loom.bench.stats import RequestRecord, summarize
from loom.bench.workloads import BenchRequest, article_workload, jsonl_workload, mixed_workload


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for starting a local server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(base_url: str, timeout: float) -> None:
    """Poll `GET /health` until it answers 200; TimeoutError if it never does within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url} was not healthy within {timeout:g} s")


async def _one(client: httpx.AsyncClient, model: str, req: BenchRequest, headers: dict) -> RequestRecord:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    record = RequestRecord(start=time.perf_counter(), end=0.0)
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if record.first_token is None:
                        record.first_token = now
                    record.chunk_times.append(now)
        if record.output_tokens != req.max_tokens:
            record.error = f"asked for {req.max_tokens} tokens, got {record.output_tokens}"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        record.error = f"{type(e).__name__}: {e}"
    finally:
        record.end = time.perf_counter()
    return record


async def run_benchmark(base_url: str, requests: list[BenchRequest], concurrency: int | None = None,
                        request_rate: float | None = None, seed: int = 0, model: str | None = None,
                        api_key: str | None = None, progress: Progress | None = None) -> tuple[list[RequestRecord], float]:
    """Send every request (bounded by `concurrency`, spaced by a Poisson process if `request_rate`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency or len(requests), 1) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600.0), limits=limits) as client:
        if model is None:
            model = (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency or len(requests))
        rng = random.Random(seed)
        task_id = progress.add_task("requests", total=len(requests)) if progress else None

        async def guarded(req: BenchRequest, delay: float) -> RequestRecord:
            await asyncio.sleep(delay)
            async with gate:
                record = await _one(client, model, req, headers)
            if progress:
                progress.advance(task_id)
            return record

        delays, t = [], 0.0
        for _ in requests:
            delays.append(t)
            if request_rate:
                t += rng.expovariate(request_rate)
        started = time.perf_counter()
        records = await asyncio.gather(*(guarded(r, d) for r, d in zip(requests, delays)))
        return list(records), time.perf_counter() - started


def _workload(args: argparse.Namespace) -> list[BenchRequest]:
    if args.workload == "article":
        return article_workload()
    if args.workload == "mixed":
        from loom.model.loader import load_model

        tokenizer = load_model(args.tokenizer_model).tokenizer
        return mixed_workload(tokenizer, args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                              seed=args.seed, as_text=True)
    return jsonl_workload(Path(args.workload))


def _table(rows: list[dict]) -> Table:
    table = Table(title="loom bench serve")
    for col in ("concurrency", "rate", "ok", "failed", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
                "ITL p50 ms", "E2E p50 ms", "goodput req/s"):
        table.add_column(col, justify="right")
    for r in rows:
        s = r["summary"]
        f = lambda d, k: "-" if d[k] is None else f"{d[k]:.0f}"  # noqa: E731
        table.add_row(str(r["concurrency"]), str(r["request_rate"]), str(s["completed"]), str(s["failed"]),
                      f"{s['request_throughput']:.2f}", f"{s['output_token_throughput']:.1f}",
                      f"{f(s['ttft_ms'], 'median')}/{f(s['ttft_ms'], 'p99')}",
                      f"{f(s['tpot_ms'], 'median')}/{f(s['tpot_ms'], 'p99')}", f(s["itl_ms"], "median"),
                      f(s["e2e_ms"], "median"), f"{s['goodput']:.2f}")
    return table


def main(args: argparse.Namespace) -> int:
    requests = _workload(args)
    console = Console(stderr=args.json)
    levels = [int(c) for c in str(args.concurrency).split(",")] if args.concurrency else [None]
    rows = []
    for level in levels:
        with Progress(console=console, transient=True, disable=args.json) as progress:
            records, duration = asyncio.run(run_benchmark(
                args.base_url, requests, level, args.request_rate, args.seed, args.model, args.api_key, progress))
        summary = summarize(records, duration, args.slo_ttft_ms, args.slo_tpot_ms)
        errors = sorted({r.error for r in records if r.error})[:3]
        rows.append({"base_url": args.base_url, "workload": args.workload, "requests": len(requests),
                     "concurrency": level, "request_rate": args.request_rate, "summary": summary, "errors": errors})
    if args.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0]))
    else:
        console.print(_table(rows))
        for r in rows:
            for e in r["errors"]:
                console.print(f"[red]error (concurrency {r['concurrency']}):[/red] {e}", markup=True)
    if args.plot and len(rows) > 1 and all(r["concurrency"] for r in rows):
        from loom.bench.plots import throughput_vs

        xs = [r["concurrency"] for r in rows]
        throughput_vs(xs, {"output tokens/s": [r["summary"]["output_token_throughput"] for r in rows]},
                      "concurrent clients", "output tokens/s", f"{args.plot}/serve_throughput.png",
                      "throughput vs concurrency")
        lat = {f"{m} {p}": [r["summary"][f"{m}_ms"][p] or 0.0 for r in rows]
               for m in ("ttft", "tpot") for p in ("median", "p99")}
        throughput_vs(xs, lat, "concurrent clients", "ms", f"{args.plot}/serve_latency.png",
                      "TTFT and TPOT percentiles vs load")
    return 0 if all(r["summary"]["failed"] == 0 for r in rows) else 1
