"""Soak: 500 requests at concurrency 64 against a real server, 20% of clients hanging up mid-stream, others with
n > 1 and stop strings. Afterwards every completed answer equals the offline engine's, and nothing leaked."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from dataclasses import dataclass, field

import httpx
from test_server import _wait_idle, running_server

from loom import LLM, SamplingParams

WORDS = "the a cat dog runs jumps over under quickly slowly machine learning attention batch token".split()


@dataclass
class Job:
    kind: str  # "stream", "disconnect", "n2", "stop"
    prompt: str
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    hang_up_after: int = 0


def make_jobs(rng: random.Random, count: int) -> list[Job]:
    jobs = []
    for _ in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        kind = rng.choices(["stream", "disconnect", "n2", "stop"], weights=[50, 20, 15, 15])[0]
        jobs.append(Job(kind, prompt, rng.randint(4, 40), stop=["e", "ab"] if kind == "stop" else [],
                        seed=rng.randrange(1 << 30), hang_up_after=rng.randint(1, 6)))
    return jobs


def offline_expected(llm: LLM, jobs: list[Job]) -> dict[int, list[str]]:
    """What each job must receive: greedy text, or n=2 seeded samples (the server seeds sample i with seed + i)."""
    prompts, params, owners = [], [], []
    for j, job in enumerate(jobs):
        if job.kind == "n2":
            for i in range(2):
                prompts.append(job.prompt)
                params.append(SamplingParams(max_tokens=job.max_tokens, temperature=1.0, seed=job.seed + i))
                owners.append(j)
        elif job.kind != "disconnect":
            prompts.append(job.prompt)
            params.append(SamplingParams(max_tokens=job.max_tokens, temperature=0.0, stop=job.stop))
            owners.append(j)
    expected: dict[int, list[str]] = {}
    for owner, out in zip(owners, llm.generate(prompts, params)):
        expected.setdefault(owner, []).append(out.text)
    return expected


async def run_job(client: httpx.AsyncClient, job: Job) -> list[str] | None:
    if job.kind == "n2":
        r = await client.post("/v1/completions", json={"prompt": job.prompt, "max_tokens": job.max_tokens, "n": 2,
                                                        "temperature": 1.0, "seed": job.seed})
        r.raise_for_status()
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    body = {"prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0, "stream": True, "stop": job.stop}
    text, events = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            if job.kind == "disconnect" and events >= job.hang_up_after:
                return None  # leaving the block closes the connection mid-stream
            text += json.loads(line[6:])["choices"][0]["text"]
    return [text]


async def soak(base: str, jobs: list[Job], concurrency: int) -> dict[int, list[str] | None]:
    limit = asyncio.Semaphore(concurrency)
    results: dict[int, list[str] | None] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        async def one(j: int) -> None:
            async with limit:
                results[j] = await run_job(client, jobs[j])

        await asyncio.gather(*(one(j) for j in range(len(jobs))))
    return results


def _rss_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))


def test_soak_500_requests_with_disconnects(tiny_llama):
    rng = random.Random(2026)
    llm = LLM(dtype="float32", loaded=tiny_llama, max_num_seqs=64)
    with running_server(tiny_llama, max_num_seqs=64, num_kv_blocks=1024) as (base, engine):
        rss, threads = [], []
        for round_no in range(2):
            jobs = make_jobs(rng, 500)
            expected = offline_expected(llm, jobs)
            results = asyncio.run(soak(base, jobs, concurrency=64))
            _wait_idle(engine)
            assert len(results) == 500
            for j, job in enumerate(jobs):
                if job.kind == "disconnect":
                    continue
                assert results[j] == expected[j], f"round {round_no} job {j} ({job.kind}) differs"
            disconnects = sum(1 for job in jobs if job.kind == "disconnect")
            assert disconnects >= 60
            assert not engine.has_unfinished_requests()
            assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
            engine.pool.check_invariants()
            rss.append(_rss_kib())
            threads.append(sorted(t.name for t in threading.enumerate()))
        # Sync FastAPI dependencies run on anyio's worker pool: pooled, at most 40 threads, idle ones retire.
        # Every other thread (engine loop, server) must be the same after round two as after round one.
        pool = "AnyIO worker thread"
        assert [t for t in threads[1] if t != pool] == [t for t in threads[0] if t != pool]
        assert threads[1].count(pool) <= 40
        assert rss[1] - rss[0] < 64 * 1024, f"RSS grew by {(rss[1] - rss[0]) / 1024:.0f} MiB in the second round"
