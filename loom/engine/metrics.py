"""The engine's Prometheus metrics, fed by its step observer on the engine thread (one registry per engine, no
globals); an engine client renders them for the server's /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loom.engine.client import EngineStats
from loom.engine.outputs import RequestOutput
from loom.engine.runner import StepResult
from loom.engine.scheduler import SchedulerOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("loom_requests_running", "Requests in the running set", registry=r).set_function(
            lambda: stats().running)
        Gauge("loom_requests_waiting", "Requests waiting for a slot", registry=r).set_function(
            lambda: stats().waiting)
        Gauge("loom_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", registry=r).set_function(
            lambda: stats().kv_usage)
        Gauge("loom_kv_blocks_total", "Usable KV blocks", registry=r).set(stats().kv_blocks_total)
        Gauge("loom_kv_blocks_used", "KV blocks held by requests", registry=r).set_function(
            lambda: stats().kv_blocks_used)
        Gauge("loom_prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission",
              registry=r).set_function(lambda: stats().prefix_cache_queries)
        Gauge("loom_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache",
              registry=r).set_function(lambda: stats().prefix_cache_hits)
        Gauge("loom_spec_decode_num_draft_tokens", "Speculation: draft tokens checked", registry=r).set_function(
            lambda: stats().draft_tokens)
        Gauge("loom_spec_decode_num_accepted_tokens", "Speculation: draft tokens accepted",
              registry=r).set_function(lambda: stats().accepted_tokens)
        self.prompt_tokens = Counter("loom_prompt_tokens", "Prompt tokens computed (prefill, incl. recompute)",
                                     registry=r)
        self.generation_tokens = Counter("loom_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("loom_preemptions", "Requests preempted for lack of KV blocks", registry=r)
        self.requests = Counter("loom_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("loom_time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("loom_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("loom_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("loom_request_queue_time_seconds", "Arrival to first scheduled",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self._last_token_time: dict[str, float] = {}

    def observe_step(self, out: SchedulerOutput, result: StepResult | None, outputs: list[RequestOutput],
                     seconds: float) -> None:
        """Runs on the engine thread after every step."""
        now = time.monotonic()
        self.prompt_tokens.inc(out.num_prefill_tokens)
        self.preemptions.inc(len(out.preempted))
        for o in outputs:
            self.generation_tokens.inc(len(o.new_token_ids))
            last = self._last_token_time.get(o.request_id)
            if last is None:
                if o.metrics.ttft is not None:
                    self.ttft.observe(o.metrics.ttft)
                if o.metrics.first_scheduled_time is not None:
                    self.queue_time.observe(o.metrics.first_scheduled_time - o.metrics.arrival_time)
            else:
                self.itl.observe(now - last)
            self._last_token_time[o.request_id] = now
            if o.finished:
                self.finish(o)

    def finish(self, o: RequestOutput) -> None:
        self._last_token_time.pop(o.request_id, None)
        self.requests.labels(o.finish_reason or "unknown").inc()
        if o.metrics.finish_time is not None:
            self.e2e.observe(o.metrics.finish_time - o.metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
