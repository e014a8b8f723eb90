"""What the engine gives back for a request after each step: its output so far and its timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.sampling import TokenLogprob


@dataclass
class RequestMetrics:
    """Monotonic-clock timestamps (seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state after a step: full text/tokens so far, plus what is new since the last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
