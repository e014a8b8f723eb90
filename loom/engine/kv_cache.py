"""Paged KV cache: a pool of fixed-size blocks handed out to requests, and the tensors that hold them.

Block 0 is the null block: never handed out, it pads block tables and absorbs writes of padding tokens,
so the pool is "full" when every other block is free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

NULL_BLOCK = 0


class BlockPool:
    """Free list plus reference counts over block ids 1..num_blocks-1."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks off the free list; the caller must have checked `num_free_blocks` first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one owner to each block (a forked request reading the same prompt blocks)."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"cannot share block {b}: it is free")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one owner from each block; a block with no owner left goes back on the free list."""
        for b in blocks:
            if b == NULL_BLOCK or self._ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]


@dataclass
class KVCacheSpec:
    """Shape of one layer's K (or V) cache: [num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for_memory(self, memory_bytes: int) -> int:
        return max(2, memory_bytes // self.bytes_per_block)

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (K, V) pair of zeroed tensors per layer."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [
            (torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device))
            for _ in range(self.num_layers)
        ]
