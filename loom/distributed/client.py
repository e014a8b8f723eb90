"""RayEngineClient: the EngineClient of engine replicas on Ray Serve. The endpoint makes and checks each request
itself (bad input never reaches a replica), then streams it from a replica through the deployment handle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from loom.distributed.metrics_board import merged_metrics_text
from loom.distributed.replica import ReplicaInfo
from loom.engine.client import EngineDead, EngineOverloaded, EngineStats, RequestFailed, RequestTimedOut
from loom.engine.input import make_request
from loom.engine.outputs import RequestOutput
from loom.sampling import SamplingParams
from loom.structured_output import GrammarCompiler

# EngineStats' fields in order, as the replicas' gauges (loom/engine/metrics.py) name them.
_STATS_GAUGES = ("loom_requests_running", "loom_requests_waiting", "loom_kv_blocks_used", "loom_kv_blocks_total",
                 "loom_prefix_cache_queries", "loom_prefix_cache_hits", "loom_spec_decode_num_draft_tokens",
                 "loom_spec_decode_num_accepted_tokens")


def _engine_error(e: BaseException) -> BaseException:
    """What a replica's failure is to the API: the engine's own errors as they are, a dead replica a failed request."""
    if isinstance(e, (ValueError, EngineOverloaded, EngineDead, RequestFailed, RequestTimedOut)):
        return e
    if isinstance(e, RayActorError):
        return RequestFailed("the replica running this request stopped")
    return RequestFailed(f"replica error: {type(e).__name__}")


class RayRequestStream:
    """One request's outputs from its replica; leaving early cancels the call, which aborts it on the replica."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], response: DeploymentResponseGenerator,
                 first: RequestOutput, on_done: Callable[[str], None]) -> None:
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.response, self.first, self.on_done = response, first, on_done

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        finished = self.first.finished
        try:
            yield self.first
            while not finished:
                try:
                    output = await self.response.__anext__()
                except StopAsyncIteration:
                    raise RequestFailed("the replica ended the request without its final output") from None
                except RayError as e:
                    raise _engine_error(e) from e
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.response.cancel()
            self.on_done(self.request_id)


class RayEngineClient:
    """Requests made here, run by the replicas behind `handle` (a deployment of EngineReplica)."""

    def __init__(self, handle: DeploymentHandle, info: ReplicaInfo, app_name: str, deployment_name: str,
                 board: ray.actor.ActorHandle) -> None:
        self.handle, self.info = handle.options(stream=True), info
        self.app_name, self.deployment_name, self.board = app_name, deployment_name, board
        self.tokenizer = info.tokenizer
        self.max_model_len = info.limits.max_model_len
        self.vocab_size = info.limits.vocab_size
        self.grammars = GrammarCompiler(info.tokenizer, info.limits.vocab_size)
        self._streams: dict[str, RayRequestStream] = {}
        self._ready_replicas, self._ready_checked = 0, 0.0

    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                  priority: int = 0) -> RayRequestStream:
        request = await asyncio.to_thread(make_request, prompt, params, tokenizer=self.tokenizer,
                                          limits=self.info.limits, grammars=self.grammars, request_id=request_id,
                                          priority=priority)
        response = self.handle.generate.remote(request.prompt_token_ids, params, request.request_id, priority)
        try:  # the first output, or the replica's refusal, before the API answers: a refusal keeps its status
            first = await response.__anext__()
        except RayError as e:
            raise _engine_error(getattr(e, "cause", None) or e) from e
        except BaseException:  # the client went away meanwhile: nothing stays running on the replica
            response.cancel()
            raise
        stream = RayRequestStream(request.request_id, request.prompt_token_ids, response, first,
                                  lambda rid: self._streams.pop(rid, None))
        self._streams[request.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.response.cancel()

    @property
    def ready_replicas(self) -> int:
        """Replicas Serve reports running (asked at most once a second)."""
        if time.monotonic() - self._ready_checked > 1.0:
            status = serve.status().applications.get(self.app_name)
            deployment = status.deployments.get(self.deployment_name) if status else None
            self._ready_replicas = deployment.replica_states.get("RUNNING", 0) if deployment else 0
            self._ready_checked = time.monotonic()
        return self._ready_replicas

    @property
    def is_healthy(self) -> bool:
        return self.ready_replicas > 0

    def health(self) -> dict:
        return {"replicas_ready": self.ready_replicas}

    def stats(self) -> EngineStats:
        """The replicas' latest posted figures, summed."""
        totals: dict[str, float] = {}
        for text in ray.get(self.board.collect.remote()).values():
            for family in text_string_to_metric_families(text.decode()):
                for sample in family.samples:
                    if sample.name in _STATS_GAUGES:
                        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return EngineStats(*(int(totals.get(name, 0)) for name in _STATS_GAUGES))

    def metrics_text(self) -> bytes:
        texts, routing = ray.get([self.board.collect.remote(), self.board.routing_counts.remote(self.app_name)])
        ready = GaugeMetricFamily("loom_replicas_ready", "Engine replicas Serve reports running")
        ready.add_metric([], self.ready_replicas)
        routed = CounterMetricFamily("loom_router_requests", "Requests the router sent to each replica, by why: "
                                     "prefix (it holds the prompt's prefix), load (least loaded), turn (round robin)",
                                     labels=["replica", "routed_by"])
        for (replica, reason), count in sorted(routing.items()):
            routed.add_metric([replica, reason], count)
        return merged_metrics_text(texts, [ready, routed])

    def stop(self) -> None:
        """The endpoint's shutdown takes its replicas down with it."""
        serve.delete(self.app_name)
