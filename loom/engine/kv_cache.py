"""Paged KV cache: a pool of fixed-size blocks handed out to requests, and the tensors that hold them.

Block 0 is the null block: never handed out, it pads block tables and absorbs writes of padding tokens,
so the pool is "full" when every other block is free.

Prefix caching: a full block whose K/V are computed is registered under a key built from its hash-chain key (the
parent block's key and the block's token ids), so a later request with the same prefix takes the block instead of
recomputing it. Which blocks a request holds is kv_manager.py's business.
A freed block keeps its key until the pool hands it out again, least recently freed first (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from loom.model.attention import KVCache
from loom.model.config import KVCacheGroup

NULL_BLOCK = 0


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """The hash-chain key of every full block of `token_ids`: a block's key covers its whole prefix."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        keys.append(parent)
    return keys


class BlockPool:
    """Reference-counted blocks 1..num_blocks-1; free ones in LRU order, some still holding a cached prefix.

    Every usable block is in exactly one state: owned (ref count > 0), free and cached (ref 0, has a key), or free
    and empty. `num_free_blocks` counts both free states: a cached block is evicted when it is handed out.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))  # oldest first
        self._ref_counts = [0] * num_blocks
        self._key_of_block: dict[int, Hashable] = {}
        self._block_of_key: dict[Hashable, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_key)

    def allocate(self, n: int) -> list[int]:
        """Take the n least recently freed blocks, evicting any cached prefix they held."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of_block.pop(block, None)
            if key is not None:
                del self._block_of_key[key]
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one owner to each block (a forked request reading the same prompt blocks)."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"cannot share block {b}: it is free")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one owner from each block; a block with no owner left becomes free (most recently freed last)."""
        for b in blocks:
            if b == NULL_BLOCK or self._ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # --- prefix cache ---------------------------------------------------------------------------------------------

    def cache_block(self, block: int, key: Hashable) -> None:
        """Register an owned, fully computed block under its key (a key already held by another block is kept)."""
        if self._ref_counts[block] <= 0:
            raise RuntimeError(f"cannot cache block {block}: it is free")
        if key not in self._block_of_key and block not in self._key_of_block:
            self._block_of_key[key] = block
            self._key_of_block[block] = key

    def cached_block(self, key: Hashable) -> int | None:
        """The block cached under `key`, if any (nothing is taken yet)."""
        return self._block_of_key.get(key)

    def take_cached(self, blocks: list[int]) -> None:
        """Add an owner to blocks found by `cached_block`, taking free ones off the free list."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks stay where they are); e.g. so benchmark runs start cold."""
        self._key_of_block.clear()
        self._block_of_key.clear()

    def check_invariants(self) -> None:
        """Every block is owned xor free; keys map both ways; the null block is never handed out (for tests)."""
        for b in range(1, self.num_blocks):
            rc = self._ref_counts[b]
            if rc < 0 or (rc == 0) != (b in self._free):
                raise AssertionError(f"block {b}: ref count {rc}, free={b in self._free}")
        if NULL_BLOCK in self._free or self._ref_counts[NULL_BLOCK] != 0:
            raise AssertionError("the null block was handed out")
        if any(self._block_of_key.get(k) != b for b, k in self._key_of_block.items()):
            raise AssertionError("prefix cache maps disagree")
        if len(self._block_of_key) != len(self._key_of_block):
            raise AssertionError("prefix cache maps differ in size")


@dataclass
class KVCacheSpec:
    """Shape of one layer's K (or V) cache: [num_blocks, block_size, num_kv_heads, head_dim] of `dtype`, or with
    `quantized` of int8 codes and a float32 scale per token and KV head (kv_cache_dtype "int8", kv_quant.py).

    A block holds block_size tokens of one KV cache group's layers; `groups` defaults to one group of every layer.
    Groups are of one size, so a block of the pool serves any of them.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    quantized: bool = False
    groups: list[KVCacheGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.groups:
            self.groups = [KVCacheGroup(tuple(range(self.num_layers)), None)]
        if len({len(g.layers) for g in self.groups}) != 1:
            raise ValueError(f"KV cache groups must be of one size, got {[len(g.layers) for g in self.groups]}")

    @property
    def layers_per_block(self) -> int:
        return len(self.groups[0].layers)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer (scales included)."""
        if self.quantized:
            per_head = self.head_dim + 4
        else:
            per_head = self.head_dim * torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_slot

    @property
    def bytes_per_slot(self) -> int:
        """One token's K and V in one group's layers: what a filled slot of a block holds."""
        return self.bytes_per_token * self.layers_per_block // self.num_layers

    def bytes_read(self, context: int) -> int:
        """K/V bytes that a query at `context` tokens reads: every earlier token in a full-attention group's layers,
        the last `window` in a sliding group's."""
        return sum(self.bytes_per_slot * (context if g.window is None else min(context, g.window))
                   for g in self.groups)

    def num_blocks_for_memory(self, memory_bytes: int) -> int:
        return max(2, memory_bytes // self.bytes_per_block)

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> list[KVCache]:
        """One KVCache per layer, of zeroed tensors: K and V are views of one buffer [num_blocks, 2, block_size,
        num_kv_heads, head_dim] in which each block's V follows its K, so decode attention, which reads a block's
        keys and then its values, reads one run of memory a block (int8 scales in tensors of their own). The i-th
        layers of all groups share one buffer: a block belongs to one group at a time."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        dtype = torch.int8 if self.quantized else self.dtype
        buffers = []
        for _ in range(self.layers_per_block):
            pairs = torch.zeros(num_blocks, 2, *shape[1:], dtype=dtype, device=device)
            scales = [torch.zeros(shape[:3], dtype=torch.float32, device=device)
                      for _ in range(2 if self.quantized else 0)]
            buffers.append(KVCache(pairs[:, 0], pairs[:, 1], *scales))
        caches: list[KVCache | None] = [None] * self.num_layers
        for group in self.groups:
            for layer, buffer in zip(group.layers, buffers):
                caches[layer] = buffer
        return caches
