"""BatchMetadata: the tensors one packed step runs on; every layer receives it explicitly (engine/batch.py builds it).

Sequences are ordered decodes first (query length 1, padding tokens included), then prefill chunks, so the
attention backend runs every decode in one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch


@dataclass
class BatchMetadata:
    """One step's packed row [T] of B sequences.

    context_lens: tokens of each sequence in the cache once this step's K/V are written.
    logits_indices: row index of the last scheduled token of each sequence that samples this step; for a request
        with draft tokens, the rows of its last real token and of each draft, in order (`sample_counts` of them).
    sampled_scheduled_index: for each sampling request, the index of its entry in `SchedulerOutput.scheduled`.
    prompt_logprob_indices: rows whose logits score a prompt token (position p scores token p + 1) for requests
        that asked for prompt logprobs; prompt_logprob_spans says whose, in the same order: (index into
        `SchedulerOutput.scheduled`, position of the first token scored, number of tokens scored).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B+1] int64
    context_lens: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, M] int64, padded with the null block
    logits_indices: torch.Tensor  # [S] int64
    num_decodes: int
    decode_max_blocks: int
    block_size: int
    # Host copies for Python-side loops over prefill chunks (no device syncs).
    query_starts: list[int]
    context_lens_host: list[int]
    num_blocks_host: list[int]
    seq_request_ids: list[str | None]  # None for a padding token
    seq_scheduled_index: list[int]  # index into SchedulerOutput.scheduled, -1 for padding
    sampled_scheduled_index: list[int]
    sample_counts: list[int]  # logits rows of each sampling sequence: 1 + its draft tokens
    prompt_logprob_indices: torch.Tensor  # [P] int64
    prompt_logprob_spans: list[tuple[int, int, int]]
    # With several KV cache groups (ModelConfig.kv_cache_groups): slot_mapping and block_tables above are group 0's,
    # these the (slot_mapping, block_tables) of groups 1, 2, ...
    other_kv_groups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def for_kv_group(self, group: int) -> BatchMetadata:
        """This step as the layers of one KV cache group see it: the group's slots and block tables."""
        if group == 0:
            return self
        slot_mapping, block_tables = self.other_kv_groups[group - 1]
        return replace(self, slot_mapping=slot_mapping, block_tables=block_tables)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_request_ids)

    def query_len(self, i: int) -> int:
        return self.query_starts[i + 1] - self.query_starts[i]

    @cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """[num_decodes, 1, 1, decode_max_blocks * block_size] bool: which keys each decode row sees. Built on first
        use (by SDPA, once a step), so that the paged kernels' steps do not pay for it."""
        if not self.num_decodes:
            return None
        key_pos = torch.arange(self.decode_max_blocks * self.block_size, device=self.context_lens.device)
        return (key_pos[None, :] < self.context_lens[: self.num_decodes, None]).view(self.num_decodes, 1, 1, -1)

    def windowed_decode_mask(self, window: int) -> torch.Tensor | None:
        """decode_mask with each row's keys limited to the last `window` (its own token's included)."""
        if not self.num_decodes:
            return None
        key_pos = torch.arange(self.decode_max_blocks * self.block_size, device=self.context_lens.device)
        lens = self.context_lens[: self.num_decodes, None]
        return ((key_pos[None, :] < lens) & (key_pos[None, :] >= lens - window)).view(self.num_decodes, 1, 1, -1)
