"""A request made from a prompt and its SamplingParams: tokenized, checked against the engine's limits, its grammar
compiled. Pure (no engine state), so it runs on worker threads, and on an endpoint whose engines run elsewhere."""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass

import torch

from loom.engine.request import Request
from loom.sampling import SamplingParams
from loom.structured_output import GrammarCompiler
from loom.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the vocabulary, the context, and the KV cache (the most tokens one request can hold
    in it alone: KVCacheManager.max_request_tokens)."""

    vocab_size: int
    max_model_len: int
    max_cached_tokens: int


def make_request(prompt: str | list[int], params: SamplingParams | None, *, tokenizer: Tokenizer,
                 limits: RequestLimits, grammars: GrammarCompiler, request_id: str | None = None,
                 arrival_time: float | None = None, priority: int = 0) -> Request:
    """Tokenize and validate: a ValueError names what is wrong with this request."""
    params = params or SamplingParams()
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    vocab = limits.vocab_size
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        text: str | None = prompt
        token_ids = tokenizer.encode(prompt)
    else:
        text, token_ids = None, list(prompt)
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
    if not token_ids:
        raise ValueError("prompt must not be empty")
    if params.truncate_prompt_tokens is not None:  # vLLM's: the prompt's last tokens (left truncation)
        keep = (max(1, limits.max_model_len - params.max_tokens) if params.truncate_prompt_tokens == -1
                else params.truncate_prompt_tokens)
        token_ids = token_ids[-keep:]
    named_ids = {"logit_bias token ids": params.logit_bias, "allowed_token_ids": params.allowed_token_ids or []}
    for name, ids in named_ids.items():
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise ValueError(f"{name} must be in [0, {vocab}), got {outside[:5]}")
    total = len(token_ids) + params.max_tokens
    if total > limits.max_model_len:
        raise ValueError(
            f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
            f"model's context length of {limits.max_model_len} tokens"
        )
    if total > limits.max_cached_tokens:
        raise ValueError(
            f"prompt + max_tokens = {total} tokens, but the KV cache holds at most {limits.max_cached_tokens} tokens "
            f"of one request"
        )
    grammar = grammars.compile(params.structured_outputs) if params.structured_outputs is not None else None
    generator = torch.Generator()
    generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return Request(
        request_id=request_id if request_id is not None else f"req-{uuid.uuid4().hex}",
        prompt_token_ids=token_ids,
        params=params,
        arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        prompt=text,
        priority=priority,
        generator=generator,
        grammar=grammar,
        bad_words_token_ids=bad_words_token_ids(tokenizer, params.bad_words),
        prompt_logprobs=[] if params.prompt_logprobs is None else [None],
        stop_token_ids_held_back=sorted(
            set(params.stop_token_ids) | set(() if params.ignore_eos else tokenizer.eos_token_ids)
        ) if params.min_tokens else [],
    )


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as the tokens it is written with at the start of a text and after a space (vLLM's way)."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
