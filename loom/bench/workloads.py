"""Benchmark workloads: the article's six requests, a seeded mix of prompt/output lengths, a shared system prompt."""

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


def shared_prefix_workload(
    tokenizer: Tokenizer,
    num_requests: int = 200,
    system_tokens: int = 300,
    output_len: tuple[int, int] = (16, 64),
    seed: int = 0,
) -> list[BenchRequest]:
    """Chat requests that share one ~`system_tokens`-token system prompt, each with its own short question.

    Rendered with the model's chat template, as a chat server would; prompts are token ids.
    """
    rng = random.Random(seed)
    text = " ".join(p for p, _ in ARTICLE_REQUESTS) * 20
    system = tokenizer.decode(tokenizer.encode(text)[:system_tokens])
    subjects = [p for p, _ in ARTICLE_REQUESTS]
    requests = []
    for i in range(num_requests):
        question = f"Question {i}: {rng.choice(subjects)} Answer in {rng.randint(1, 5)} sentences."
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        requests.append(BenchRequest(ids, rng.randint(*output_len)))
    return requests


def tenants_workload(
    tokenizer: Tokenizer,
    tenants: int = 8,
    system_tokens: int = 500,
    num_requests: int = 256,
    output_len: tuple[int, int] = (16, 64),
    seed: int = 0,
) -> list[BenchRequest]:
    """Chat requests from `tenants` tenants, each with its own `system_tokens`-token system prompt, in seeded random
    order: the traffic a prefix-aware router is for. Prompts are token ids, rendered with the chat template."""
    rng = random.Random(seed)
    text_ids = tokenizer.encode(" ".join(p for p, _ in ARTICLE_REQUESTS) * 40)
    systems = []
    for tenant in range(tenants):
        start = rng.randrange(0, len(text_ids) - system_tokens)
        systems.append(f"You answer for tenant {tenant}. " + tokenizer.decode(text_ids[start:start + system_tokens]))
    subjects = [p for p, _ in ARTICLE_REQUESTS]
    requests = []
    for i in range(num_requests):
        messages = [{"role": "system", "content": systems[rng.randrange(tenants)]},
                    {"role": "user", "content": f"Question {i}: {rng.choice(subjects)}"}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                               add_special_tokens=False)
        requests.append(BenchRequest(ids, rng.randint(*output_len)))
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
