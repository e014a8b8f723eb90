"""Request routers for Loom's engine replicas, on Ray Serve's public RequestRouter API.

`prefix` (the default) sends a request to the replica that already holds the longest part of its prompt in its
prefix cache, judged by the block-hash chain Loom's cache uses (loom/engine/kv_cache.py), kept per replica from what
this router sent there (approximate, bounded, least recently used first out). When the replicas' queues are uneven
(SGLang's rule: the longest minus the shortest above an absolute threshold, and the longest above a multiple of the
shortest) it takes the least-loaded replica instead. `pow2` (the power of two choices on queue length) and
`round_robin` are there to compare. A replica's load is the larger of what it last reported and the requests
this router sent it that have not completed (the report lags by up to a second).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from loom.distributed.replica import LOOM_NAMESPACE, METRICS_BOARD
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


class LoomRouter(RequestRouter):
    """What every Loom router keeps: each replica's requests in flight from here, and why each request went where
    it went, counted on the metrics board for the endpoint's /metrics.

    A router names the replica it prefers and why in choose_replicas (`prefer`); Serve may ask more than once for
    one request and may place it on a fallback, so the reason is settled when the request is routed.
    """

    max_pending = 4096  # preferences kept for requests not yet routed (some are cancelled first)

    def initialize_state(self, **kwargs) -> None:
        self.in_flight: dict[ReplicaID, int] = {}
        self.generating: set[str] = set()  # generate requests routed and not completed (other calls are not load)
        self.preferred: OrderedDict[str, tuple[ReplicaID, str]] = OrderedDict()
        self.board: ray.actor.ActorHandle | None = None
        self.setup(**kwargs)

    def setup(self) -> None:
        """The router's own state."""

    def load(self, replica: RunningReplica) -> float:
        stats = replica.routing_stats or {}
        reported = float(stats.get("running", 0)) + float(stats.get("waiting", 0))
        return max(reported, float(self.in_flight.get(replica.replica_id, 0)))

    def prefer(self, pending_request: PendingRequest | None, replica_id: ReplicaID, reason: str) -> None:
        if pending_request is None:
            return
        self.preferred[pending_request.metadata.internal_request_id] = (replica_id, reason)
        while len(self.preferred) > self.max_pending:
            self.preferred.popitem(last=False)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        preferred = self.preferred.pop(pending_request.metadata.internal_request_id, None)
        if pending_request.metadata.call_method != "generate":
            return
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.generating.add(pending_request.metadata.internal_request_id)
        self.routed(pending_request, replica_id)
        reason = preferred[1] if preferred is not None and preferred[0] == replica_id else "load"
        try:
            self.board = self.board or ray.get_actor(METRICS_BOARD, namespace=LOOM_NAMESPACE)
            self.board.routed.remote(replica_id.deployment_id.app_name, replica_id.unique_id, reason)
        except ValueError:  # no board: nobody reads the counts
            self.board = None

    def routed(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        """A generate request went to `replica_id`."""

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if internal_request_id in self.generating:
            self.generating.discard(internal_request_id)
            if self.in_flight.get(replica_id, 0) > 0:
                self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.in_flight.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)


class PrefixAwareRouter(LoomRouter):
    """Prefix affinity by the prefix cache's block-hash chain; the least-loaded replica when queues are uneven."""

    def setup(self, imbalanced_threshold: float = 8.0, imbalanced_ratio: float = 1.5,
              max_blocks_per_replica: int = 65536) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.imbalanced_ratio = imbalanced_ratio
        self.max_blocks_per_replica = max_blocks_per_replica
        self.tables: dict[ReplicaID, _PrefixTable] = {}

    def _table(self, replica_id: ReplicaID) -> _PrefixTable:
        return self.tables.setdefault(replica_id, _PrefixTable(self.max_blocks_per_replica))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        loads = {r.replica_id: self.load(r) for r in candidate_replicas}
        fewest, most = min(loads.values()), max(loads.values())
        least = random.choice([r for r in candidate_replicas if loads[r.replica_id] == fewest])
        if most - fewest > self.imbalanced_threshold and most > self.imbalanced_ratio * fewest:
            self.prefer(pending_request, least.replica_id, "load")
            return [[least]]
        keys = block_hashes(_prompt_ids(pending_request), BLOCK_SIZE)
        matched = {r.replica_id: self._table(r.replica_id).matched(keys) for r in candidate_replicas}
        best = max(matched.values(), default=0)
        if best == 0:  # nobody holds any of it: the least loaded, as for a new prefix
            self.prefer(pending_request, least.replica_id, "load")
            return [[least]]
        holder = min((r for r in candidate_replicas if matched[r.replica_id] == best),
                     key=lambda r: loads[r.replica_id])
        self.prefer(pending_request, holder.replica_id, "prefix")
        return [[holder], [least]]

    def routed(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        self._table(replica_id).add(block_hashes(_prompt_ids(pending_request), BLOCK_SIZE))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.tables.pop(replica_id, None)  # a restarted replica starts with an empty cache
        super().on_replica_actor_died(replica_id)


class PowerOfTwoRouter(LoomRouter):
    """Two replicas drawn at random; the one with the shorter queue."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        return [[min(pair, key=self.load)]]


class RoundRobinRouter(LoomRouter):
    """Each replica in turn, whatever it holds. A request keeps its turn when Serve asks again for it (it may ask
    more than once, and for many requests before any is routed)."""

    def setup(self) -> None:
        self.turn = 0
        self.turns: OrderedDict[str, int] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: str(r.replica_id))
        key = pending_request.metadata.internal_request_id if pending_request is not None else ""
        if key not in self.turns:
            self.turns[key], self.turn = self.turn, self.turn + 1
            while len(self.turns) > self.max_pending:
                self.turns.popitem(last=False)
        chosen = ordered[self.turns[key] % len(ordered)]
        self.prefer(pending_request, chosen.replica_id, "turn")
        return [[chosen]]

    def routed(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        self.turns.pop(pending_request.metadata.internal_request_id, None)


ROUTERS = {"prefix": PrefixAwareRouter, "pow2": PowerOfTwoRouter, "round_robin": RoundRobinRouter}
