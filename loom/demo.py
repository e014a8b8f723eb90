"""`loom demo`: the article's experiment on the bundled model, static then continuous on the same engine.

Six requests with caps 6, 50, 300, 30, 180, 45 tokens share 3 slots. Every admission and completion is logged
with its step and slot; the packed row and block-diagonal mask are drawn for step 1 and for the first step that
fuses a new prompt's prefill with other requests' decodes; wall times, speed-up and padding are reported, and
both runs must give identical text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.console import Console

from loom.config import SchedulerConfig
from loom.engine.engine import LLMEngine
from loom.engine.outputs import RequestOutput
from loom.engine.runner import StepResult
from loom.engine.scheduler import SchedulerOutput
from loom.engine.trace import StepRecord, StepTracer
from loom.sampling import SamplingParams
from loom.viz import mask_lines, packed_row_lines

ARTICLE_REQUESTS = [
    ("The capital of France is", 6),
    ("Today's weather is so", 50),
    ("In machine learning, a transformer is", 300),
    ("Once upon a time in a land far away,", 30),
    ("Quantum computing differs from classical computing because", 180),
    ("The history of the Roman Empire began", 45),
]
NUM_SLOTS = 3


@dataclass
class DemoRun:
    policy: str
    seconds: float
    texts: list[str]
    steps: int
    useful_tokens: int
    pad_tokens: int
    figures: list[int] = field(default_factory=list)  # steps whose packed row was drawn
    trace: list[StepRecord] = field(default_factory=list)


def run_policy(engine: LLMEngine, policy: str, console: Console, draw: bool) -> DemoRun:
    """Run the six requests under one scheduling policy, logging admissions, completions and (optionally) steps."""
    engine.set_scheduler(SchedulerConfig(max_num_seqs=NUM_SLOTS, max_num_batched_tokens=2048, policy=policy))
    say = lambda line, style=None: console.print(line, style=style, markup=False, highlight=False)  # noqa: E731
    label = lambda rid: "-" if rid is None else chr(ord("A") + int(rid))  # noqa: E731
    slots: dict[str, int] = {}
    caps = {str(i): cap for i, (_, cap) in enumerate(ARTICLE_REQUESTS)}
    run = DemoRun(policy, 0.0, [], 0, 0, 0)
    mixed_drawn = False

    def observe(out: SchedulerOutput, result: StepResult | None, outputs: list[RequestOutput], seconds: float) -> None:
        nonlocal mixed_drawn
        run.steps = out.step
        run.useful_tokens += out.num_scheduled_tokens
        run.pad_tokens += out.num_pad_tokens
        for r in out.admitted:
            slots[r.request_id] = r.slot
            say(
                f"++ [step {out.step:3d}] slot {r.slot} <- admit req {r.request_id} "
                f"({r.params.max_tokens} tok cap): {r.prompt!r}",
                style="green",
            )
        if policy == "static" and out.admitted:
            longest = max(r.params.max_tokens for r in out.admitted)
            say(
                f"*** batch barrier: all {len(out.admitted)} slots wait for the longest ({longest} tokens) ***",
                style="yellow",
            )
        if draw and result is not None:
            meta = result.metadata
            kinds = {meta.query_len(i) > 1 for i in range(meta.num_seqs)}
            mixed = kinds == {True, False} and bool(out.admitted)
            if out.step == 1 or (mixed and not mixed_drawn):
                mixed_drawn = mixed_drawn or mixed
                title = "prompts packed together (all PREFILL)" if out.step == 1 else "PREFILL + DECODE fused in one pass"
                say("=" * 72, "cyan")
                say(f"STEP {out.step} - {title}", "bold cyan")
                for line in packed_row_lines(meta, engine.tokenizer, label, slots) + mask_lines(meta, label):
                    say(line)
                run.figures.append(out.step)
        for o in outputs:
            if o.finished:
                n = len(o.token_ids)
                say(
                    f"-- [step {out.step:3d}] slot {slots[o.request_id]} done req {o.request_id} "
                    f"({n}/{caps[o.request_id]} tokens): {(o.prompt or '') + o.text!r:.90}",
                    "red",
                )

    ids = [
        engine.add_request(p, SamplingParams(max_tokens=cap, temperature=0.0), request_id=str(i))
        for i, (p, cap) in enumerate(ARTICLE_REQUESTS)
    ]
    tracer = StepTracer(engine)
    started = time.perf_counter()
    with engine.observing(observe), engine.observing(tracer):
        finals = engine.run_to_completion()
    run.seconds = time.perf_counter() - started
    run.trace = tracer.records
    run.texts = [finals[i].text for i in ids]
    return run


def run_demo(engine: LLMEngine, console: Console) -> tuple[DemoRun, DemoRun]:
    console.print(f"Loom demo on {engine.loaded.name} ({str(engine.config.dtype).removeprefix('torch.')}), "
                  f"{NUM_SLOTS} slots, {len(ARTICLE_REQUESTS)} requests", style="bold")
    console.print("\n=== Static batching (padded waves, barrier at the longest request) ===", style="bold")
    static = run_policy(engine, "static", console, draw=False)
    console.print(f"\nStatic batching elapsed: {static.seconds:.2f}s in {static.steps} steps", style="bold")
    console.print("\n=== Continuous batching (iteration-level scheduling + ragged packed rows) ===", style="bold")
    continuous = run_policy(engine, "continuous", console, draw=True)
    console.print(f"\nContinuous batching elapsed: {continuous.seconds:.2f}s in {continuous.steps} steps", style="bold")

    identical = static.texts == continuous.texts
    total = static.useful_tokens + static.pad_tokens
    console.print("\n=== Summary ===", style="bold")
    console.print(f"static:     {static.seconds:7.2f} s  {static.steps:4d} steps")
    console.print(f"continuous: {continuous.seconds:7.2f} s  {continuous.steps:4d} steps")
    console.print(f"speed-up:   {static.seconds / continuous.seconds:7.2f}x")
    console.print(
        f"static computed {total} tokens: {static.useful_tokens} useful + {static.pad_tokens} padding "
        f"({100 * static.pad_tokens / max(total, 1):.1f}% wasted); continuous computed {continuous.useful_tokens}, no padding"
    )
    console.print(
        f"identical text in both runs: {'yes' if identical else 'NO'}", style="bold green" if identical else "bold red"
    )
    return static, continuous
