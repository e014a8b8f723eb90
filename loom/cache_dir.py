"""Where Loom keeps what it derives once per machine (dequantized weights, the compiled attention kernel)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$LOOM_CACHE_DIR, else ~/.cache/loom."""
    return Path(os.environ.get("LOOM_CACHE_DIR", Path.home() / ".cache" / "loom"))
