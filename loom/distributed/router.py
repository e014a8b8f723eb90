"""Request routers for Loom's engine replicas, on Ray Serve's public RequestRouter API.

`prefix` (the default) sends a request to the replica that already holds the longest part of its prompt in its
prefix cache, judged by the block-hash chain Loom's cache uses (loom/engine/kv_cache.py), kept per replica from what
this router sent there (approximate, bounded, least recently used first out). When the replicas' queues are uneven
(SGLang's rule: the longest minus the shortest above an absolute threshold, and the longest above a multiple of the
shortest) it takes the least-loaded replica instead. `pow2` (the power of two choices on queue length) and
`round_robin` are there to compare.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from loom.engine.kv_cache import block_hashes

BLOCK_SIZE = 16  # Loom's KV block: the prefix cache shares whole blocks only


class _PrefixTable:
    """The block keys one replica was sent, least recently used first out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def matched(self, keys: list[int]) -> int:
        """How many of `keys` (a prompt's chain, in order) this replica holds from the first on."""
        count = 0
        for key in keys:
            if key not in self.keys:
                break
            count += 1
        return count

    def add(self, keys: list[int]) -> None:
        for key in keys:
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


def _prompt_ids(pending_request: PendingRequest | None) -> list[int]:
    """The token ids the request carries (EngineReplica.generate's first argument)."""
    if pending_request is None or not pending_request.args:
        return []
    first = pending_request.args[0]
    return first if isinstance(first, list) else []


def _load(replica: RunningReplica) -> float:
    """Requests the replica reported running and waiting (record_routing_stats), 0 before its first report."""
    stats = replica.routing_stats or {}
    return float(stats.get("running", 0)) + float(stats.get("waiting", 0))


class PrefixAwareRouter(RequestRouter):
    """Prefix affinity by the prefix cache's block-hash chain; the least-loaded replica when queues are uneven."""

    def initialize_state(self, imbalanced_threshold: float = 8.0, imbalanced_ratio: float = 1.5,
                         max_blocks_per_replica: int = 65536) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.imbalanced_ratio = imbalanced_ratio
        self.max_blocks_per_replica = max_blocks_per_replica
        self.tables: dict[ReplicaID, _PrefixTable] = {}

    def _table(self, replica_id: ReplicaID) -> _PrefixTable:
        return self.tables.setdefault(replica_id, _PrefixTable(self.max_blocks_per_replica))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        loads = {r.replica_id: _load(r) for r in candidate_replicas}
        least = min(candidate_replicas, key=lambda r: loads[r.replica_id])
        most, fewest = max(loads.values()), min(loads.values())
        if most - fewest > self.imbalanced_threshold and most > self.imbalanced_ratio * fewest:
            return [[least]]
        keys = block_hashes(_prompt_ids(pending_request), BLOCK_SIZE)
        matched = {r.replica_id: self._table(r.replica_id).matched(keys) for r in candidate_replicas}
        best = max(matched.values(), default=0)
        if best == 0:  # nobody holds any of it: the least loaded, as for a new prefix
            return [[least]]
        holders = [r for r in candidate_replicas if matched[r.replica_id] == best]
        return [sorted(holders, key=lambda r: loads[r.replica_id])[:1], [least]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self._table(replica_id).add(block_hashes(_prompt_ids(pending_request), BLOCK_SIZE))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.tables.pop(replica_id, None)  # a restarted replica starts with an empty cache
        super().on_replica_actor_died(replica_id)


class PowerOfTwoRouter(RequestRouter):
    """Two replicas drawn at random; the one with the shorter queue."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        return [[min(pair, key=_load)]]


class RoundRobinRouter(RequestRouter):
    """Each replica in turn, whatever it holds. The turn moves when a request is routed (Serve may ask
    choose_replicas more than once for one request)."""

    def initialize_state(self) -> None:
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: str(r.replica_id))
        return [[ordered[self.turn % len(ordered)]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        self.turn += 1


ROUTERS = {"prefix": PrefixAwareRouter, "pow2": PowerOfTwoRouter, "round_robin": RoundRobinRouter}
