"""Building and loading Loom's C++ kernels."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from loom.model import kernels


def test_a_build_killed_midway_does_not_hang_later_loads():
    """torch leaves its `lock` file behind when a build is killed, and its loaders wait on it forever; Loom's
    loader removes it (no other Loom process can be building) and loads the kernel."""
    assert kernels.load_layer_ops() is not None, "the C++ kernels must build on the CI machine"
    leftover = kernels.build_directory("loom_layer_ops", ["layer_ops.cpp"]) / "lock"
    leftover.touch()
    try:
        load = "import loom.model.kernels as k; assert k.load_layer_ops() is not None"
        done = subprocess.run([sys.executable, "-c", load], timeout=120, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "left by a build that did not finish" in done.stderr
        assert not leftover.exists()
    finally:
        leftover.unlink(missing_ok=True)


def test_two_checkouts_share_one_build_and_changed_sources_get_their_own(tmp_path):
    """The build is keyed by what is compiled, not by where the checkout is: a second copy of Loom loads the first's
    kernel without compiling; a copy whose source differs is given another build directory."""
    assert kernels.load_layer_ops() is not None
    built = kernels.build_directory("loom_layer_ops", ["layer_ops.cpp"])
    library = next(built.glob("*.so"))
    stamp = library.stat().st_mtime_ns
    package = Path(kernels.__file__).parents[2] / "loom"
    ask = ("import loom.model.kernels as k; assert k.load_layer_ops() is not None; "
           "print(k.build_directory('loom_layer_ops', ['layer_ops.cpp']))")
    for checkout in ("a", "b"):
        shutil.copytree(package, tmp_path / checkout / "loom", ignore=shutil.ignore_patterns("__pycache__"))
        done = subprocess.run([sys.executable, "-c", ask], timeout=120, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(tmp_path / checkout)}, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(built)
    assert library.stat().st_mtime_ns == stamp  # loaded, never rebuilt
    changed = tmp_path / "b" / "loom" / "model" / "csrc" / "layer_ops.cpp"
    changed.write_text(changed.read_text() + "\n// a change\n")
    other = subprocess.run([sys.executable, "-c", "import loom.model.kernels as k; "
                            "print(k.build_directory('loom_layer_ops', ['layer_ops.cpp']))"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path / "b")},
                           cwd=tmp_path)
    assert other.returncode == 0 and other.stdout.strip() != str(built)
