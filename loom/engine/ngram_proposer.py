"""Draft tokens by prompt lookup (vLLM's "ngram" speculation): text that repeats earlier text, as a small model's
output, a quote of the prompt or code being edited often does, is proposed from where it appeared before."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loom.config import SpeculativeConfig


@dataclass
class NgramProposer:
    config: SpeculativeConfig

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the latest earlier occurrence of the longest suffix of
        `token_ids` (prompt_lookup_max tokens down to prompt_lookup_min) that occurred before; [] if none did."""
        max_drafts = min(max_drafts, self.config.num_speculative_tokens)
        if max_drafts <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.config.prompt_lookup_max, len(tokens) - 1), self.config.prompt_lookup_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + max_drafts].tolist()
        return []
