"""Which tokens of which requests run in the next step: continuous (iteration-level) and static (padded waves).

Both emit a `SchedulerOutput`, the one contract with the runner: plain Python, no tensors.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field

from loom.config import SchedulerConfig
from loom.engine.kv_manager import KVCacheManager
from loom.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: `token_ids` fed at positions start_position.. (its num_computed_tokens)."""

    request: Request
    token_ids: list[int]
    start_position: int
    block_tables: tuple[list[int], ...]  # one per KV cache group
    sample: bool  # the chunk reaches the request's last token, so a new token is sampled from it
    slot: int  # the request's place in the running set this step
    # Speculation: proposed tokens fed after the request's last token (the tail of `token_ids`); the step checks them.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """One token past the prompt; anything else (a prompt chunk, a recompute after preemption) is prefill."""
        return len(self.token_ids) == 1 and self.start_position >= self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_pad_tokens: int = 0  # static batching only: wasted tokens computed to keep the wave rectangular
    padding_slots: list[tuple[int, str]] = field(default_factory=list)  # static: (slot, finished request) idling
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled if not s.is_decode and not s.draft_token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.num_pad_tokens


def _order(request: Request) -> tuple[int, int]:
    """Queue order: lower priority value first, then first come first served."""
    return request.priority, request.arrival_index


class Scheduler:
    """State shared by both policies: waiting queue, running set, slots, and the KV cache's blocks (`kv`).

    Both `waiting` and `running` are kept in queue order (priority, then arrival), so the head of `waiting` is
    admitted next and the tail of `running` (lowest priority, newest) is preempted first.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, enable_prefix_caching: bool = False) -> None:
        self.config = config
        self.kv = kv
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._free_slots = list(range(config.max_num_seqs))
        self._step = 0
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens whose K/V came from the cache

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.arrival_index = next(self._arrivals)
        bisect.insort(self.waiting, request, key=_order)

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        """After a step: `num_tokens` more of the request have K/V; full blocks among them join the prefix cache."""
        request.num_computed_tokens += num_tokens
        if self.enable_prefix_caching:
            self.kv.cache_computed(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Retire a request (stopped, length or abort): its blocks and slot go back at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.monotonic()

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        if request.slot is not None:
            self._free_slots.append(request.slot)
            self._free_slots.sort()
            request.slot = None

    def _admit(self, request: Request, out: SchedulerOutput) -> None:
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        request.slot = self._free_slots.pop(0)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        bisect.insort(self.running, request, key=_order)
        out.admitted.append(request)

    def _take_cached_prefix(self, request: Request) -> int:
        """Give a request with nothing computed the cached blocks of its longest cached prefix; returns their count.

        At least its last token is left to compute, so the step that finishes the prompt has logits to sample. A
        request that wants prompt logprobs takes none: cached positions have no logits to score its prompt with.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens or request.params.prompt_logprobs is not None:
            return 0
        return self.kv.take_cached_prefix(request)

    def _return_cached_prefix(self, request: Request) -> None:
        """Undo `_take_cached_prefix` for a request that could not be admitted after all."""
        self.kv.free(request)
        request.num_computed_tokens = 0

    def _schedule_chunk(self, request: Request, num_tokens: int, out: SchedulerOutput,
                        drafts: list[int] | None = None) -> None:
        start = request.num_computed_tokens
        end = start + num_tokens
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                token_ids=request.token_ids(start, end) + (drafts or []),
                start_position=start,
                block_tables=self.kv.block_tables(request),
                sample=end == request.num_tokens,
                slot=request.slot,
                draft_token_ids=drafts or [],
            )
        )

    def _next_output(self) -> SchedulerOutput:
        self._step += 1
        return SchedulerOutput(step=self._step)


class ContinuousScheduler(Scheduler):
    """Iteration-level scheduling with chunked prefill and recompute preemption.

    Running requests go first (their decodes are never starved by a new prompt), each taking what it still
    needs up to the token budget; then waiting requests are admitted in queue order (priority, then FCFS) into
    free slots with what budget is left, a long prompt in chunks across steps, its cached prefix skipped. Out of
    blocks: the lowest-priority, newest running request is preempted.

    Latency protection: a prompt longer than one step's budget would otherwise fill step after step with a large
    chunk that attends to an ever longer context, multiplying every decoding request's inter-token latency. While
    requests decode, such long prompts share an allowance of max(long_prefill_chunk_tokens, decoding requests)
    token-equivalents a step, where a prompt token at position p counts 1 + p / keys_per_token (its attention
    grows with the context; keys_per_token is where that attention costs as many FLOPs as the token's matmuls).
    So a step carries about as much long-prompt work as decode work, and the long prompt still moves every step.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, enable_prefix_caching: bool = False,
                 keys_per_token: float = math.inf) -> None:
        super().__init__(config, kv, enable_prefix_caching)
        self.keys_per_token = keys_per_token

    def schedule(self) -> SchedulerOutput:
        out = self._next_output()
        budget = self.config.max_num_batched_tokens
        long_allowance = self._long_prefill_allowance()
        # Draft tokens take only budget that no running request's next token needs.
        decodes_left = sum(r.awaits_next_token for r in self.running)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts: list[int] = []
            if request.awaits_next_token:
                drafts = request.draft_token_ids[: max(0, budget - decodes_left)]
                decodes_left -= 1
            long = self._is_long_prefill(request)
            if long:
                n = self._paced_chunk(request, n, long_allowance)
                if n == 0:  # the long prompts' share of this step is spent
                    index += 1
                    continue
            while not self.kv.allocate(request, request.num_computed_tokens + n + len(drafts)):
                if drafts:  # drafts are the first to give way when blocks run out
                    drafts = []
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            if long:
                long_allowance -= self._prefill_cost(request.num_computed_tokens, n)
            self._schedule_chunk(request, n, out, drafts)
            budget -= n + len(drafts)
            index += 1

        if not out.preempted:
            while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
                request = self.waiting[0]
                long = self._is_long_prefill(request)
                if long and long_allowance <= 0:
                    break  # queue order holds: nobody overtakes a long prompt that waits for its share
                num_cached = self._take_cached_prefix(request)
                n = min(request.num_tokens - request.num_computed_tokens, budget)
                if long:
                    n = self._paced_chunk(request, n, long_allowance)
                if not self.kv.allocate(request, request.num_computed_tokens + n):
                    if num_cached:
                        self._return_cached_prefix(request)
                    break
                if self.enable_prefix_caching:
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += num_cached * self.kv.block_size
                if long:
                    long_allowance -= self._prefill_cost(request.num_computed_tokens, n)
                self._admit(request, out)
                self._schedule_chunk(request, n, out)
                budget -= n
        return out

    def _is_long_prefill(self, request: Request) -> bool:
        """Still prefilling (more than its next token left) a context that does not fit one step's budget."""
        return (request.num_tokens - request.num_computed_tokens > 1
                and request.num_tokens > self.config.max_num_batched_tokens)

    def _long_prefill_allowance(self) -> float:
        """Token-equivalents long prompts may take this step: no limit unless someone is decoding."""
        decoding = sum(r.awaits_next_token for r in self.running)
        if not decoding or not self.config.long_prefill_chunk_tokens:
            return math.inf
        return max(self.config.long_prefill_chunk_tokens, decoding)

    def _prefill_cost(self, start: int, n: int) -> float:
        """Token-equivalents of prompt positions start..start+n-1: sum of 1 + p / keys_per_token."""
        return n + (n * start + n * (n - 1) / 2) / self.keys_per_token

    def _paced_chunk(self, request: Request, n: int, allowance: float) -> int:
        """The longest chunk (at most n) whose cost fits the allowance; at least one token while any is left."""
        if allowance <= 0:
            return 0
        if allowance == math.inf:
            return n
        # cost(m) = a*m^2 + b*m with a = 1/(2K), b = 1 + (start - 1/2)/K: the positive root of cost(m) = allowance.
        a = 0.5 / self.keys_per_token
        b = 1 + (request.num_computed_tokens - 0.5) / self.keys_per_token
        fit = allowance / b if a == 0 else (math.sqrt(b * b + 4 * a * allowance) - b) / (2 * a)
        return min(n, max(1, math.floor(fit + 1e-9)))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free the request's blocks and queue it first in line; its K/V are recomputed when it returns."""
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_order)  # ahead of later arrivals of its priority
        out.preempted.append(request)


class StaticScheduler(Scheduler):
    """The baseline: waves of up to max_num_seqs requests, each a padded rectangle run to its longest request.

    A wave's prompts are prefilled together, padded to the longest prompt; then every slot computes one token
    per step until the wave's longest request ends (finished requests compute padding). Nobody is admitted
    until the whole wave is done. Blocks for prompt + max_tokens are reserved at admission, so a wave never
    preempts. `num_pad_tokens` counts the wasted work the rectangle costs.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        super().__init__(config, kv)
        self.wave: list[Request] = []
        self._wave_slots: dict[str, int] = {}
        self.num_pad_tokens = 0

    def schedule(self) -> SchedulerOutput:
        out = self._next_output()
        if all(r.is_finished for r in self.wave):
            self.wave = []
            self._wave_slots = {}
            while self.waiting and len(self.wave) < self.config.max_num_seqs:
                request = self.waiting[0]
                if not self.kv.allocate(request, request.num_prompt_tokens + request.params.max_tokens):
                    break
                self._admit(request, out)
                self.wave.append(request)
                self._wave_slots[request.request_id] = request.slot
        if not self.wave:
            return out

        prefilling = [r for r in self.wave if not r.is_finished and r.num_computed_tokens < r.num_prompt_tokens]
        if prefilling:
            longest = max(r.num_prompt_tokens for r in self.wave)
            for r in prefilling:
                self._schedule_chunk(r, r.num_tokens - r.num_computed_tokens, out)
            out.num_pad_tokens = sum(longest - r.num_prompt_tokens for r in self.wave)
        else:
            for r in self.wave:
                if r.is_finished:
                    out.num_pad_tokens += 1
                    out.padding_slots.append((self._wave_slots[r.request_id], r.request_id))
                else:
                    self._schedule_chunk(r, 1, out)
        self.num_pad_tokens += out.num_pad_tokens
        return out
