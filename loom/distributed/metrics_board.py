"""The endpoint's view of every replica's Prometheus metrics: replicas post their text to a named actor, and
/metrics shows each sample once per replica with a `replica` label, beside the router's counters."""

from __future__ import annotations

import time

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families


@ray.remote(num_cpus=0)
class MetricsBoard:
    """Each replica's latest metrics text; a replica that stopped posting (dead, restarted) drops out."""

    def __init__(self, max_age_s: float = 5.0) -> None:
        self.max_age_s = max_age_s
        self.texts: dict[str, tuple[float, bytes]] = {}
        self.routing: dict[tuple[str, str, str], int] = {}

    def routed(self, app: str, replica: str, reason: str) -> None:
        """A router sent one request of `app` to `replica` for `reason` (prefix, load, turn)."""
        key = (app, replica, reason)
        self.routing[key] = self.routing.get(key, 0) + 1

    def routing_counts(self, app: str) -> dict[tuple[str, str], int]:
        """Requests of `app` routed so far, by replica and reason (replicas since gone included)."""
        return {(replica, reason): n for (a, replica, reason), n in self.routing.items() if a == app}

    def post(self, replica: str, text: bytes) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def collect(self) -> dict[str, bytes]:
        now = time.monotonic()
        self.texts = {r: (t, text) for r, (t, text) in self.texts.items() if now - t <= self.max_age_s}
        return {r: text for r, (_, text) in self.texts.items()}


class _Merged:
    """A prometheus_client collector of the replicas' families, each sample labelled with its replica."""

    def __init__(self, texts: dict[str, bytes], extra: list[Metric]) -> None:
        self.texts, self.extra = texts, extra

    def collect(self):
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text.decode()):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value,
                                      sample.timestamp, sample.exemplar)
        yield from families.values()
        yield from self.extra


def merged_metrics_text(texts: dict[str, bytes], extra: list[Metric]) -> bytes:
    registry = CollectorRegistry()
    registry.register(_Merged(texts, extra))
    return generate_latest(registry)
