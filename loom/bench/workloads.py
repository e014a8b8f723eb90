"""Benchmark workloads: the article's six requests and a seeded synthetic mix of prompt/output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loom.demo import ARTICLE_REQUESTS
from loom.tokenizer import Tokenizer


@dataclass
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


def article_workload() -> list[BenchRequest]:
    return [BenchRequest(p, n) for p, n in ARTICLE_REQUESTS]


def mixed_workload(
    tokenizer: Tokenizer,
    num_requests: int = 200,
    prompt_len: tuple[int, int] = (20, 400),
    output_len: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of uniform random length cut from real text tokens (so they look like language), seeded."""
    rng = random.Random(seed)
    base = tokenizer.encode(" ".join(p for p, _ in ARTICLE_REQUESTS) * 40)
    requests = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        start = rng.randrange(0, len(base) - n)
        requests.append(BenchRequest(base[start : start + n], rng.randint(*output_len)))
    return requests
