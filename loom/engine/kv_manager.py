"""Which KV blocks each request holds: one manager per attention kind, all drawing on one shared BlockPool.

A model's layers form KV cache groups (`ModelConfig.kv_cache_groups`), and each group gives every request a block
table of its own. `FullAttentionBlocks` keeps every block of a request's context. `SlidingWindowBlocks` keeps only
the blocks its window can still reach: as the request moves on, blocks that fell behind the window go back to the
pool (keeping their prefix-cache key) and their table entries become the null block, which no query reads.
`KVCacheManager` speaks for all groups to the scheduler: an allocation succeeds for every group or for none, and a
cached prefix is taken only as far as every group still holds what the tokens after it will read.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from loom.engine.kv_cache import NULL_BLOCK, BlockPool, block_hashes
from loom.engine.request import Request
from loom.model.config import KVCacheGroup


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class FullAttentionBlocks:
    """One group's block table for each request (by request id); every block of the context is kept."""

    def __init__(self, pool: BlockPool, block_size: int, group: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group = group
        self.tables: dict[str, list[int]] = {}

    def _key(self, chain_key: int) -> Hashable:
        """A block's prefix-cache key: its hash-chain key within this group (groups hold different layers' K/V)."""
        return self.group, chain_key

    def drop_unreachable(self, request_id: str, num_computed: int) -> None:
        """Full attention reads every earlier position: nothing to drop."""

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return max(0, _ceil_div(num_tokens, self.block_size) - len(self.tables.get(request_id, ())))

    def grow(self, request_id: str, n: int) -> None:
        self.tables.setdefault(request_id, []).extend(self.pool.allocate(n))

    def cache_blocks(self, request_id: str, keys: Sequence[int], start: int) -> None:
        """Register the request's blocks start..len(keys)-1 (full and computed) under their keys."""
        table = self.tables[request_id]
        for i in range(start, len(keys)):
            if table[i] != NULL_BLOCK:
                self.pool.cache_block(table[i], self._key(keys[i]))

    def longest_hit(self, keys: Sequence[int], limit: int) -> int:
        """The most leading blocks (at most `limit`) whose K/V the cache holds: a prefix of that many is reusable."""
        for n in range(limit):
            if self.pool.cached_block(self._key(keys[n])) is None:
                return n
        return limit

    def take_hit(self, request_id: str, keys: Sequence[int], n: int) -> None:
        """Give the request the cached blocks of its first n keys (`longest_hit` said they are there)."""
        table = [self.pool.cached_block(self._key(k)) for k in keys[:n]]
        self.pool.take_cached(table)
        self.tables[request_id] = table

    def free(self, request_id: str) -> None:
        """Return every block the request holds, tail first: shared prefix blocks stay cached longest."""
        table = self.tables.pop(request_id, [])
        self.pool.free([b for b in reversed(table) if b != NULL_BLOCK])

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of `num_tokens` holds at once, fed at most `max_chunk` tokens a step."""
        return _ceil_div(num_tokens, self.block_size)


class SlidingWindowBlocks(FullAttentionBlocks):
    """A window of W: a query at position p reads keys (p - W, p], so once a request has computed s tokens, blocks
    wholly before position s - W + 1 are read by no query to come and go back to the pool."""

    def __init__(self, pool: BlockPool, block_size: int, group: int, window: int) -> None:
        super().__init__(pool, block_size, group)
        self.window = window
        self._dropped: dict[str, int] = {}  # leading table entries already swapped for the null block

    def first_reachable(self, num_computed: int) -> int:
        """Index of the first block the queries from position `num_computed` on can read."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def drop_unreachable(self, request_id: str, num_computed: int) -> None:
        table = self.tables.get(request_id)
        if not table:
            return
        start, end = self._dropped.get(request_id, 0), min(self.first_reachable(num_computed), len(table))
        if end > start:
            self.pool.free([b for b in table[start:end] if b != NULL_BLOCK])
            table[start:end] = [NULL_BLOCK] * (end - start)
            self._dropped[request_id] = end

    def longest_hit(self, keys: Sequence[int], limit: int) -> int:
        """The longest prefix (at most `limit` blocks) whose last blocks within the window are all cached: the
        blocks before them are never read again, so they need not be cached."""
        best = run = 0
        for n in range(1, limit + 1):
            run = run + 1 if self.pool.cached_block(self._key(keys[n - 1])) is not None else 0
            if run >= n - self.first_reachable(n * self.block_size):
                best = n
        return best

    def take_hit(self, request_id: str, keys: Sequence[int], n: int) -> None:
        first = self.first_reachable(n * self.block_size)
        cached = [self.pool.cached_block(self._key(k)) for k in keys[first:n]]
        self.pool.take_cached(cached)
        self.tables[request_id] = [NULL_BLOCK] * first + cached
        self._dropped[request_id] = first

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._dropped.pop(request_id, None)

    def max_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """A step's chunk of c tokens reads back W - 1 positions: its blocks span at most (c + W - 1) / size + 1."""
        return min(_ceil_div(num_tokens, self.block_size), _ceil_div(max_chunk + self.window - 1, self.block_size) + 1)


class KVCacheManager:
    """Every group's blocks of every request, on one pool: what the scheduler asks of the KV cache."""

    def __init__(self, pool: BlockPool, block_size: int, groups: Sequence[KVCacheGroup]) -> None:
        self.pool = pool
        self.block_size = block_size
        self.groups = [FullAttentionBlocks(pool, block_size, i) if g.window is None
                       else SlidingWindowBlocks(pool, block_size, i, g.window) for i, g in enumerate(groups)]

    def block_tables(self, request: Request) -> tuple[list[int], ...]:
        """The request's block table in each group (live lists: they grow as the request does)."""
        return tuple(g.tables.setdefault(request.request_id, []) for g in self.groups)

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Give the request blocks to hold `num_tokens` tokens in every group, if the pool has them all; first the
        blocks its windows left behind go back."""
        rid = request.request_id
        for g in self.groups:
            g.drop_unreachable(rid, request.num_computed_tokens)
        needs = [g.blocks_needed(rid, num_tokens) for g in self.groups]
        if sum(needs) > self.pool.num_free_blocks:
            return False
        for g, n in zip(self.groups, needs):
            if n:
                g.grow(rid, n)
        return True

    def take_cached_prefix(self, request: Request) -> int:
        """Give a request with nothing computed the blocks of its longest prefix that every group can serve;
        returns the number of blocks (per group). Its last token is always left to compute, so the step that ends
        the prompt has logits to sample."""
        keys = block_hashes(request.token_ids(0, request.num_tokens - 1), self.block_size)
        n, settled = len(keys), False
        while not settled:  # a shorter hit in one group can make another group's window miss: repeat until all agree
            settled = True
            for g in self.groups:
                hit = g.longest_hit(keys, n)
                settled, n = settled and hit == n, hit
        if n:
            for g in self.groups:
                g.take_hit(request.request_id, keys, n)
            request.block_hashes = keys[:n]
            request.num_computed_tokens = n * self.block_size
        return n

    def cache_computed(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache of every group."""
        num_full = request.num_computed_tokens // self.block_size
        done = len(request.block_hashes)
        if num_full > done:
            tokens = request.token_ids(done * self.block_size, num_full * self.block_size)
            parent = request.block_hashes[-1] if done else None
            request.block_hashes.extend(block_hashes(tokens, self.block_size, parent))
            for g in self.groups:
                g.cache_blocks(request.request_id, request.block_hashes, done)

    def free(self, request: Request) -> None:
        """Return every block of the request, in every group."""
        for g in self.groups:
            g.free(request.request_id)
        request.block_hashes = []

    def max_request_tokens(self, max_chunk: int) -> int:
        """The longest request (prompt + output) the whole pool can hold alone, fed at most `max_chunk` tokens a
        step: requests longer than this are refused at admission rather than preempted forever."""
        def fits(tokens: int) -> bool:
            return sum(g.max_blocks(tokens, max_chunk) for g in self.groups) <= self.pool.num_usable_blocks

        low, high = 0, self.block_size
        while fits(high) and high < 1 << 40:  # sliding groups alone never run out: cap the search
            low, high = high, 2 * high
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low
