"""The BatchMetadata of one step (loom/model/batch_metadata.py), built from a SchedulerOutput with numpy, no per-token
loops."""

from __future__ import annotations

import numpy as np
import torch

from loom.engine.kv_cache import NULL_BLOCK
from loom.engine.scheduler import SchedulerOutput
from loom.model.batch_metadata import BatchMetadata


def build_batch_metadata(
    out: SchedulerOutput, block_size: int, num_kv_groups: int = 1, pad_token_id: int = 0,
    device: torch.device | str = "cpu",
) -> BatchMetadata:
    """Pack the scheduled chunks (decodes first) into one unpadded row with positions, and the slots and block
    tables of each of the `num_kv_groups` KV cache groups."""
    sched = out.scheduled
    # A one-token prompt chunk (the last token of a prompt whose blocks came from the prefix cache, or of a chunked
    # prompt) is prefill: the prefill kernel gives it the bits it gets inside a longer chunk. A request's last token
    # and its draft tokens go as one chunk, whose rows share each read of the request's K/V (as decode rows, each
    # row would read the cache again).
    decode_idx = [i for i, s in enumerate(sched) if s.is_decode]
    prefill_idx = [i for i, s in enumerate(sched) if not s.is_decode]
    n_pad = out.num_pad_tokens
    # (index into `scheduled` or -1 for padding, query length)
    rows = [(i, 1) for i in decode_idx] + [(-1, 1)] * n_pad + [(i, len(sched[i].token_ids)) for i in prefill_idx]
    order = [i for i, _ in rows]
    num_seqs = len(rows)

    q_lens = np.fromiter((q for _, q in rows), np.int64, num_seqs)
    starts = np.fromiter((sched[i].start_position if i >= 0 else 0 for i, _ in rows), np.int64, num_seqs)
    cu = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])

    input_ids = np.empty(num_tokens, np.int64)
    for row, (i, _) in enumerate(rows):
        input_ids[cu[row] : cu[row + 1]] = sched[i].token_ids if i >= 0 else pad_token_id

    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - cu[:-1], q_lens)
    context_lens = starts + q_lens

    num_blocks = (-(-context_lens // block_size)).tolist()  # blocks the context spans (a request may own more)
    max_blocks = max(num_blocks) if num_blocks else 1
    group_tables = []
    for group in range(num_kv_groups):
        tables = np.full((num_seqs, max_blocks), NULL_BLOCK, np.int64)
        for row, i in enumerate(order):
            if i >= 0:
                tables[row, : num_blocks[row]] = sched[i].block_tables[group][: num_blocks[row]]
        slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        group_tables.append((slot_mapping, tables))

    # Logits at each sampling sequence's last token, and for a request with drafts at each of its chunk's tokens.
    sample_rows = [row for row, i in enumerate(order) if i >= 0 and sched[i].sample]
    logits_indices = np.array([t for row in sample_rows
                               for t in (range(cu[row], cu[row + 1]) if sched[order[row]].draft_token_ids
                                         else (cu[row + 1] - 1,))], np.int64)
    sampled_scheduled_index = [order[row] for row in sample_rows]
    sample_counts = [1 + len(sched[i].draft_token_ids) for i in sampled_scheduled_index]

    score_rows: list[int] = []
    prompt_logprob_spans: list[tuple[int, int, int]] = []
    for row in range(num_seqs - len(prefill_idx), num_seqs):  # a decode is past its prompt
        chunk = sched[order[row]]
        needed = chunk.request.prompt_logprobs_needed
        first = max(chunk.start_position, needed.start)
        last = min(chunk.start_position + len(chunk.token_ids), needed.stop)
        if first < last:
            prompt_logprob_spans.append((order[row], first + 1, last - first))
            row_of_first = int(cu[row]) + first - chunk.start_position
            score_rows.extend(range(row_of_first, row_of_first + last - first))

    num_decodes = num_seqs - len(prefill_idx)
    decode_max_blocks = max(num_blocks[:num_decodes]) if num_decodes else 0
    on_cpu = torch.device(device).type == "cpu"

    def t(a: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(a))
        return tensor if on_cpu else tensor.to(device)

    return BatchMetadata(
        input_ids=t(input_ids),
        positions=t(positions),
        cu_seqlens_q=t(cu),
        context_lens=t(context_lens),
        slot_mapping=t(group_tables[0][0]),
        block_tables=t(group_tables[0][1]),
        logits_indices=t(logits_indices),
        num_decodes=num_decodes,
        decode_max_blocks=decode_max_blocks,
        block_size=block_size,
        query_starts=cu.tolist(),
        context_lens_host=context_lens.tolist(),
        num_blocks_host=num_blocks,
        seq_request_ids=[sched[i].request.request_id if i >= 0 else None for i in order],
        seq_scheduled_index=order,
        sampled_scheduled_index=sampled_scheduled_index,
        sample_counts=sample_counts,
        prompt_logprob_indices=t(np.array(score_rows, np.int64)),
        prompt_logprob_spans=prompt_logprob_spans,
        other_kv_groups=[(t(slots), t(tables)) for slots, tables in group_tables[1:]],
    )
