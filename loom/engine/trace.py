"""Step trace: what each step ran (per slot), how long it took and how full the KV pool was.

Recording is a step observer, so it costs nothing when not attached. Export as Chrome trace-event JSON
(opens in Perfetto / chrome://tracing) with one complete event per step.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loom.engine.engine import LLMEngine
from loom.engine.kv_cache import NULL_BLOCK
from loom.engine.outputs import RequestOutput
from loom.engine.runner import StepResult
from loom.engine.scheduler import SchedulerOutput


@dataclass
class SlotUse:
    slot: int
    request_id: str
    kind: str  # "prefill", "decode" or "padding"


@dataclass
class StepRecord:
    step: int
    start: float  # seconds since the trace began
    duration: float
    prefill_tokens: int
    decode_tokens: int
    pad_tokens: int
    sampled_tokens: int  # rows that went through the LM head (a chunk stopping mid-prompt samples none)
    num_scheduled: int
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    tokens_in_cache: int  # filled KV slots of running requests' blocks (shared blocks once): the rest is waste
    slots: list[SlotUse] = field(default_factory=list)


class StepTracer:
    """Attach with `engine.observing(tracer)`; read `records` afterwards."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.records: list[StepRecord] = []
        self._t0 = time.perf_counter()

    def __call__(self, out: SchedulerOutput, result: StepResult | None, outputs: list[RequestOutput],
                 seconds: float) -> None:
        end = time.perf_counter() - self._t0
        scheduler, pool = self.engine.scheduler, self.engine.pool
        slots = [
            SlotUse(s.slot, s.request.request_id, "decode" if s.is_decode or s.draft_token_ids else "prefill")
            for s in out.scheduled
        ]
        slots += [SlotUse(slot, rid, "padding") for slot, rid in out.padding_slots]
        self.records.append(StepRecord(
            step=out.step,
            start=end - seconds,
            duration=seconds,
            prefill_tokens=out.num_prefill_tokens,
            decode_tokens=out.num_scheduled_tokens - out.num_prefill_tokens,
            pad_tokens=out.num_pad_tokens,
            sampled_tokens=0 if result is None else sum(len(t) for t in result.tokens),
            num_scheduled=len(out.scheduled),
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            blocks_used=pool.num_used_blocks,
            blocks_total=pool.num_usable_blocks,
            tokens_in_cache=self._filled_slots(),
            slots=slots,
        ))

    def _filled_slots(self) -> int:
        """Slots holding a computed token, in every KV cache group, counting a block shared through the prefix cache
        once.

        A request's blocks before its computed tokens' end are full, the one they end in is partly filled, the rest
        are empty. Only full blocks are shared (the prefix cache keeps whole blocks), so the partly filled ones are
        counted per request and the full ones as a set, gathered by set.update rather than visited one by one in
        Python: a 64-request step holds ~1300 blocks, and visiting them doubled the tracer's time within the timed
        mixed run (0.30-0.35 s of its ~20.5 s against 0.17 s)."""
        block_size = self.engine.config.cache.block_size
        full: set[int] = set()
        partly = 0
        for r in self.engine.scheduler.running:
            whole, rest = divmod(r.num_computed_tokens, block_size)
            for table in self.engine.kv.block_tables(r):  # one per KV cache group
                full.update(table[:whole])
                if whole < len(table):
                    partly += rest
        full.discard(NULL_BLOCK)  # where a sliding window gave blocks back
        return len(full) * block_size + partly

    def to_chrome_trace(self) -> dict:
        events = []
        for r in self.records:
            args = {k: v for k, v in asdict(r).items() if k not in ("slots", "start", "duration")}
            events.append({"name": f"step {r.step}", "cat": "step", "ph": "X", "pid": 1, "tid": 1,
                           "ts": round(r.start * 1e6, 3), "dur": round(r.duration * 1e6, 3), "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome_trace()))
        return path
