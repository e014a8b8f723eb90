"""The article's two pictures, drawn from the runner's real BatchMetadata: the packed row and its mask.

`#` = the query may attend to the key, `.` = blocked. Keys are laid out as the article does:
[ cached K/V of every sequence | this step's new tokens ].
"""

from __future__ import annotations

from collections.abc import Callable

from loom.model.batch_metadata import BatchMetadata
from loom.tokenizer import Tokenizer


def packed_row_lines(
    meta: BatchMetadata, tokenizer: Tokenizer, label: Callable[[str | None], str], slots: dict[str, int]
) -> list[str]:
    """One line per sequence of the step: its label, slot, PREFILL(n) or decode(1), and the tokens fed."""
    ids = meta.input_ids.tolist()
    lines = [
        f"{meta.num_seqs} sequences packed into ONE unpadded row of shape [1, {meta.num_tokens}] "
        f"({sum(meta.context_lens_host) - meta.num_tokens} tokens already cached)"
    ]
    for i, rid in enumerate(meta.seq_request_ids):
        n = meta.query_len(i)
        cached = meta.context_lens_host[i] - n
        kind = f"PREFILL({n})" if cached == 0 else f"decode({n})" if n == 1 else f"chunk({n})"
        toks = " ".join(repr(tokenizer.decode([t], skip_special_tokens=False)) for t in ids[meta.query_starts[i] : meta.query_starts[i + 1]])
        if len(toks) > 66:
            toks = toks[:63] + "..."
        slot = slots.get(rid, -1) if rid is not None else -1
        lines.append(f"  {label(rid)} = slot {slot} {kind:<12} {toks}")
    return lines


def mask_lines(meta: BatchMetadata, label: Callable[[str | None], str]) -> list[str]:
    """The block-diagonal causal mask over [cached | new] keys, one row per query token."""
    seqs = range(meta.num_seqs)
    q_lens = [meta.query_len(i) for i in seqs]
    cached = [meta.context_lens_host[i] - q_lens[i] for i in seqs]
    # Each key: (sequence, position); cached keys of all sequences first, then this step's new tokens.
    keys = [(i, p) for i in seqs for p in range(cached[i])] + [
        (i, cached[i] + j) for i in seqs for j in range(q_lens[i])
    ]
    num_cached = sum(cached)

    def row(cells: list[str]) -> str:
        parts = []
        for k, cell in enumerate(cells):
            if num_cached and k == num_cached:
                parts.append(" | ")
            elif k and keys[k][0] != keys[k - 1][0]:
                parts.append(" ")
            parts.append(cell)
        return "".join(parts)

    lines = ["block-diagonal causal mask (row = query, col = key)   # attend   . blocked"]
    if num_cached:
        lines.append("key layout: [ cached KV | this step's new tokens ]")
    lines.append(f"{'keys:':>8} " + row([label(meta.seq_request_ids[s]) for s, _ in keys]))
    for i in seqs:
        for j in range(q_lens[i]):
            q_pos = cached[i] + j
            cells = ["#" if s == i and p <= q_pos else "." for s, p in keys]
            lines.append(f"{label(meta.seq_request_ids[i]) + ' p' + str(q_pos):>8} " + row(cells))
    return lines
