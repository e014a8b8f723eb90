"""EngineReplica: one Loom engine as a Ray Serve replica. It receives token ids, never text, and streams outputs."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray import serve

from loom.config import EngineConfig
from loom.engine.async_engine import AsyncEngine
from loom.engine.engine import LLMEngine
from loom.engine.input import RequestLimits
from loom.engine.outputs import RequestOutput
from loom.sampling import SamplingParams
from loom.tokenizer import Tokenizer

METRICS_BOARD = "loom-metrics-board"  # the named actor replicas post their metrics to, in LOOM_NAMESPACE
LOOM_NAMESPACE = "loom"


@dataclass
class ReplicaInfo:
    """What the endpoint needs to know of the model, from a replica: it loads no weights itself."""

    model_name: str
    tokenizer: Tokenizer
    limits: RequestLimits
    description: str


class EngineReplica:
    def __init__(self, config: EngineConfig, max_waiting: int | None = None,
                 request_timeout: float | None = None, metrics_period_s: float = 1.0) -> None:
        self.engine = AsyncEngine(lambda: LLMEngine(config), max_waiting=max_waiting, request_timeout=request_timeout)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._stop = threading.Event()
        self._poster = threading.Thread(target=self._post_metrics, args=(metrics_period_s,), daemon=True,
                                        name="loom-metrics")
        self._poster.start()

    def info(self) -> ReplicaInfo:
        engine = self.engine.engine
        return ReplicaInfo(engine.loaded.name, engine.tokenizer, engine.request_limits, engine.describe())

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The request's outputs as its steps make them; cancelled by the caller, it is aborted here."""
        stream = await self.engine.add(prompt_token_ids, params, request_id, priority)
        async for output in stream.outputs():
            yield output

    def record_routing_stats(self) -> dict[str, float]:
        """Serve's periodic report to the routers: this replica's load and cache."""
        stats = self.engine.stats()
        return {"running": stats.running, "waiting": stats.waiting, "kv_usage": stats.kv_usage,
                "prefix_cache_hits": stats.prefix_cache_hits}

    def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError("the engine loop stopped")

    def _post_metrics(self, period_s: float) -> None:
        board = None
        while not self._stop.wait(period_s):
            try:
                board = board or ray.get_actor(METRICS_BOARD, namespace=LOOM_NAMESPACE)
                board.post.remote(self.replica_id, self.engine.metrics_text())
            except ValueError:  # no board (yet): nobody reads these metrics
                board = None

    def __del__(self) -> None:
        self._stop.set()
        self.engine.stop()
