"""Benchmark workloads: the article's six requests and a seeded synthetic mix of prompt/output lengths."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

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
    as_text: bool = False,
) -> list[BenchRequest]:
    """Prompts of uniform random length cut from real text tokens (so they look like language), seeded.

    `as_text` decodes each prompt back to text, for servers whose tokenizer may differ from ours.
    """
    rng = random.Random(seed)
    base = tokenizer.encode(" ".join(p for p, _ in ARTICLE_REQUESTS) * 40)
    requests = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        start = rng.randrange(0, len(base) - n)
        ids = base[start : start + n]
        requests.append(BenchRequest(tokenizer.decode(ids) if as_text else ids, rng.randint(*output_len)))
    return requests


def jsonl_workload(path: Path) -> list[BenchRequest]:
    """One `{"prompt": ..., "max_tokens": ...}` object per line."""
    requests = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item.get("prompt"), (str, list)) or not isinstance(item.get("max_tokens"), int):
            raise ValueError(f"{path}:{line_no}: each line needs a prompt and an integer max_tokens")
        requests.append(BenchRequest(item["prompt"], item["max_tokens"]))
    return requests
