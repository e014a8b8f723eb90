"""Loom's C++ CPU kernels, compiled on first use with torch.utils.cpp_extension and cached per machine.

`make install` builds them (`loom.model.kernels.build()`), so a server's first start does not pay the ~1 minute
compile. If no compiler is available, `load_paged_attention()` returns None and callers fall back to torch ops.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

from loom.cache_dir import default_cache_dir

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def _build_dir() -> Path:
    """One build per torch version and CPU model: -march=native code must not move to another machine."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    key = hashlib.sha256(f"{torch.__version__}:{cpu}:{_FLAGS}".encode()).hexdigest()[:12]
    return default_cache_dir() / "kernels" / key


def load_paged_attention(verbose: bool = False) -> ModuleType | None:
    """The compiled `decode_attention` module, or None (with a warning) if it cannot be built here."""
    from torch.utils import cpp_extension

    build_dir = _build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name="loom_paged_attention",
            sources=[str(_SOURCE)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler, no ninja, a failed build
        log.warning("paged attention kernel unavailable (%s); using the torch SDPA path", exc)
        return None


def build() -> None:
    """Compile (or find cached) every kernel now and say whether it is usable; `make install` calls this."""
    logging.basicConfig(level=logging.INFO)
    module = load_paged_attention()
    print("loom paged attention kernel:", "ready" if module else "unavailable (torch SDPA will be used)")
