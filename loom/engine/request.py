"""One request's state as it moves waiting -> running -> finished (and back to waiting if preempted)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from loom.sampling import SamplingParams, TokenLogprob
from loom.structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Prompt, output so far, and how much of it already has K/V in the cache (`num_computed_tokens`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    # EOS (unless ignore_eos) and stop_token_ids: masked from the logits while fewer than params.min_tokens are out.
    stop_token_ids_held_back: list[int] = field(default_factory=list)
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params.prompt_logprobs: entry k scores prompt token k given tokens 0..k-1; entry 0 is None (nothing
    # precedes it). Filled as prompt chunks run, each position once, even when a preempted request recomputes.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    output_text: str = ""
    num_computed_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)  # hash-chain keys of its full, computed blocks
    arrival_index: int = 0  # set by the scheduler: FCFS order within a priority
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    slot: int | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # with params.structured_outputs: where the output stands in its grammar
    draft_token_ids: list[int] = field(default_factory=list)  # speculation: proposed next tokens, checked next step
    draft_limit: int | None = None  # speculation: the most drafts its next check takes (set by its first proposal)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words as token sequences

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prompt_logprobs_needed(self) -> range:
        """Prompt positions whose logits still owe a prompt logprob (position p scores token p + 1)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(0, len(self.prompt_logprobs) - 1), self.num_prompt_tokens - 1)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def awaits_next_token(self) -> bool:
        """Everything but its last token has K/V: the next step decodes it (with any draft tokens)."""
        return self.num_tokens - self.num_computed_tokens == 1

    @property
    def below_min_tokens(self) -> bool:
        return self.num_output_tokens < self.params.min_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole concatenation."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
