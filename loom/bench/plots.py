"""PNG plots (matplotlib, Agg): slot timelines, KV usage, throughput and latency against load."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from loom.engine.trace import StepRecord  # noqa: E402

# tab20 without its two greys, which are kept for padding.
_COLORS = [plt.get_cmap("tab20")(i) for i in range(20) if i not in (14, 15)]


def slot_timeline(traces: dict[str, list[StepRecord]], num_slots: int, path: str | Path, title: str = "") -> Path:
    """Gantt of slots x steps per policy: a colour per request, solid = decode, hatched = prefill, grey = padding."""
    panel_height = min(0.5 * num_slots, 6.0)  # many slots get thinner rows, not a taller figure
    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 1.2 + panel_height * len(traces)), squeeze=False,
                             sharex=True)
    for ax, (name, records) in zip(axes[:, 0], traces.items()):
        order: dict[str, int] = {}  # colour by order of first appearance, so both policies colour alike
        for r in records:
            for use in r.slots:
                if use.kind == "padding":
                    ax.barh(use.slot, 1, left=r.step - 1, color="0.75", edgecolor="none")
                else:
                    color = _COLORS[order.setdefault(use.request_id, len(order)) % len(_COLORS)]
                    ax.barh(use.slot, 1, left=r.step - 1, color=color, edgecolor="none",
                            hatch="///" if use.kind == "prefill" else None)
        ax.set_ylabel(f"{name}\nslot")
        ax.set_yticks(range(0, num_slots, max(1, num_slots // 16)))
        ax.set_ylim(-0.6, num_slots - 0.4)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {len(records)} steps", loc="left", fontsize=9)
    axes[-1, 0].set_xlabel("step (white = idle slot)")
    fig.legend(handles=[Patch(facecolor="0.5", hatch="///", label="prefill"), Patch(facecolor="0.5", label="decode"),
                        Patch(facecolor="0.75", label="padding (static)")], loc="upper right", ncols=3, fontsize=8)
    fig.suptitle(title or "slot timeline", x=0.01, ha="left")
    return _save(fig, path)


def kv_usage(traces: dict[str, list[StepRecord]], path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for name, records in traces.items():
        ax.plot([r.start + r.duration for r in records], [100 * r.blocks_used / r.blocks_total for r in records],
                label=name)
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV blocks used (%)")
    ax.legend()
    ax.set_title("KV cache usage over time")
    return _save(fig, path)


def throughput_vs(xs: list[float], series: dict[str, list[float]], xlabel: str, ylabel: str, path: str | Path,
                  title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
