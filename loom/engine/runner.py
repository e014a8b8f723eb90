"""The model runner: SchedulerOutput -> BatchMetadata -> one forward over the packed row -> sampled tokens."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from loom.engine.batch import build_batch_metadata
from loom.engine.kv_cache import KVCacheSpec
from loom.engine.scheduler import SchedulerOutput
from loom.model.attention import AttentionBackend
from loom.model.batch_metadata import BatchMetadata
from loom.model.sampler import Sampler, score_tokens
from loom.sampling import TokenLogprob

# Prompt logprobs take the LM head over every prompt row: 256 rows of SmolLM2's 49,152 float32 logits are 50 MB at a
# time, where a 2048-token chunk at once would be 400 MB.
PROMPT_LOGPROB_ROWS_AT_ONCE = 256


@dataclass
class StepResult:
    """Aligned with SchedulerOutput.scheduled: the tokens each request emits (none for a chunk that stops mid-prompt;
    with draft tokens, the accepted drafts and one more), with their logprobs where asked for."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]
    prompt_logprobs: dict[int, list[TokenLogprob]]  # by index into `scheduled`: its chunk's scored prompt tokens
    metadata: BatchMetadata
    forward_seconds: float  # the model's forward over the packed row
    logits_seconds: float  # final norm and LM head of the sampled rows (0 when none samples)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]: a view where the rows run on one after another (every row of a step whose requests all check
    drafts: copying 384 rows of SmolLM2's logits took ~10 ms), else a copy."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    return logits.index_select(0, torch.tensor(rows))


class ModelRunner:
    """Owns the model, its paged KV tensors, the attention backend and the sampler."""

    def __init__(self, model, kv_spec: KVCacheSpec, num_blocks: int, attention: AttentionBackend,
                 sampler: Sampler) -> None:
        self.model = model
        self.kv_spec = kv_spec
        self.num_blocks = num_blocks
        self.kv_caches = kv_spec.allocate(num_blocks)
        self.attention = attention
        self.sampler = sampler

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        meta = build_batch_metadata(out, self.kv_spec.block_size, len(self.kv_spec.groups))
        started = time.perf_counter()
        hidden = self.model.forward(meta, self.kv_caches, self.attention)
        forwarded = time.perf_counter()
        num = len(out.scheduled)
        tokens: list[list[int]] = [[] for _ in range(num)]
        logprobs: list[list[TokenLogprob | None]] = [[] for _ in range(num)]
        logits_seconds = 0.0
        if meta.sampled_scheduled_index:
            # index_select copies whole rows (indexing copies element by element: 11.0 -> 4.2 us for 64 rows).
            logits = self.model.compute_logits(hidden.index_select(0, meta.logits_indices))
            logits_seconds = time.perf_counter() - forwarded
            for i, toks, lps in self._sample(logits, meta, out):
                tokens[i], logprobs[i] = toks, lps
        prompt_logprobs = self._score_prompts(hidden, meta, out) if meta.prompt_logprob_spans else {}
        return StepResult(tokens, logprobs, prompt_logprobs, meta, forwarded - started, logits_seconds)

    def _sample(self, logits: torch.Tensor, meta: BatchMetadata,
                out: SchedulerOutput) -> list[tuple[int, list[int], list[TokenLogprob | None]]]:
        """(index into `scheduled`, tokens, logprobs) of each sampling request: one token each, or for those with
        draft tokens the ones their check accepts and one more."""
        index = meta.sampled_scheduled_index
        requests = [out.scheduled[i].request for i in index]
        if all(count == 1 for count in meta.sample_counts):
            sampled, lps = self.sampler.sample(logits, requests)
            return [(i, [tok], [lp]) for i, tok, lp in zip(index, sampled, lps)]
        starts = [0, *itertools.accumulate(meta.sample_counts)]
        plain = [j for j, count in enumerate(meta.sample_counts) if count == 1]
        spec = [j for j, count in enumerate(meta.sample_counts) if count > 1]
        results = []
        if plain:
            sampled, lps = self.sampler.sample(_rows(logits, [starts[j] for j in plain]), [requests[j] for j in plain])
            results += [(index[j], [tok], [lp]) for j, tok, lp in zip(plain, sampled, lps)]
        rows = [row for j in spec for row in range(starts[j], starts[j + 1])]
        emitted, lps = self.sampler.verify(_rows(logits, rows), [requests[j] for j in spec],
                                           [out.scheduled[index[j]].draft_token_ids for j in spec])
        return results + [(index[j], toks, lp) for j, toks, lp in zip(spec, emitted, lps)]

    def _score_prompts(self, hidden: torch.Tensor, meta: BatchMetadata,
                       out: SchedulerOutput) -> dict[int, list[TokenLogprob]]:
        """Log-probabilities of the prompt tokens that this step's chunks score, from the logits of the rows before."""
        rows = hidden.index_select(0, meta.prompt_logprob_indices)
        scored: dict[int, list[TokenLogprob]] = {}
        offset = 0
        for index, first, count in meta.prompt_logprob_spans:
            request = out.scheduled[index].request
            targets = request.prompt_token_ids[first : first + count]
            lps: list[TokenLogprob] = []
            for start in range(0, count, PROMPT_LOGPROB_ROWS_AT_ONCE):
                end = min(count, start + PROMPT_LOGPROB_ROWS_AT_ONCE)
                logits = self.model.compute_logits(rows[offset + start : offset + end])
                lps += score_tokens(logits, targets[start:end], request.params.prompt_logprobs)
            scored[index] = lps
            offset += count
        return scored
