"""What this CPU offers, read from /proc/cpuinfo: the kernels' build key and `--dtype auto`'s choice."""

from __future__ import annotations

from pathlib import Path

# Either extension multiplies bfloat16 in hardware; without them bfloat16 is emulated and float32 is faster.
BFLOAT16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpuinfo_line(prefix: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with `prefix` ("model name", "flags"), or None where there is none."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(prefix))
    except (OSError, StopIteration):
        return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    line = cpuinfo_line("flags")
    return set(line.split(":", 1)[1].split()) if line else set()


def auto_dtype() -> tuple[str, str]:
    """The dtype `auto` stands for here, and why: bfloat16 where the CPU multiplies it in hardware."""
    found = [flag for flag in BFLOAT16_FLAGS if flag in cpu_flags()]
    if found:
        return "bfloat16", f"the CPU has {' and '.join(found)}"
    return "float32", f"the CPU has none of {', '.join(BFLOAT16_FLAGS)}"
