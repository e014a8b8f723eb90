"""Building and loading Loom's C++ kernels."""

from __future__ import annotations

import subprocess
import sys

from loom.model import kernels


def test_a_build_killed_midway_does_not_hang_later_loads():
    """torch leaves its `lock` file behind when a build is killed, and its loaders wait on it forever; Loom's
    loader removes it (no other Loom process can be building) and loads the kernel."""
    assert kernels.load_layer_ops() is not None, "the C++ kernels must build on the CI machine"
    leftover = kernels._build_dir() / "loom_layer_ops" / "lock"
    leftover.touch()
    try:
        load = "import loom.model.kernels as k; assert k.load_layer_ops() is not None"
        done = subprocess.run([sys.executable, "-c", load], timeout=120, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "left by a build that did not finish" in done.stderr
        assert not leftover.exists()
    finally:
        leftover.unlink(missing_ok=True)
