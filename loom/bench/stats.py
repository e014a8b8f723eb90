"""Serving-benchmark arithmetic on per-request records: throughput, latency percentiles, goodput under SLOs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """One benchmark request as the client saw it (perf_counter seconds)."""

    start: float
    end: float
    output_tokens: int = 0
    prompt_tokens: int = 0
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every streamed chunk with text/tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def distribution(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, median, p90, p99 (linear interpolation), scaled (default: seconds -> ms)."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=float) * scale
    return {"mean": float(a.mean()), "median": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(records: list[RequestRecord], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)

    def meets_slo(r: RequestRecord) -> bool:
        if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > slo_ttft_ms):
            return False
        if slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1000 > slo_tpot_ms:
            return False
        return True

    good = [r for r in ok if meets_slo(r)]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_token_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration if duration > 0 else 0.0,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution([x for r in ok for x in r.itls]),
        "e2e_ms": distribution([r.end - r.start for r in ok]),
        "goodput": len(good) / duration if duration > 0 else 0.0,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
    }
