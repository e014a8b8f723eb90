"""Loom's C++ CPU kernels, compiled on first use with torch.utils.cpp_extension and cached per machine.

`make install` builds them (`loom.model.kernels.build()`), so a server's first start does not pay the ~5 minute
compile. Each kernel is its own module: if one cannot be built here (no compiler, or a CPU without AVX2 for the
packed linear), its loader returns None and callers fall back to torch ops.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from loom.cache_dir import default_cache_dir
from loom.cpu import cpu_flags, cpuinfo_line

log = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def _build_key(sources: list[Path]) -> str:
    """What a build depends on: its sources' and every header's contents, the compiler flags, torch's version and
    the CPU (-march=native code must not move to another machine). Checkouts and environments with the same key
    share one build; a checkout whose sources differ gets its own."""
    digest = hashlib.sha256()
    for path in sorted(sources) + sorted(_SOURCES.glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    cpu = cpuinfo_line("model name") or platform.processor() or platform.machine()
    flags = " ".join(sorted(cpu_flags()))
    digest.update(f"{_FLAGS}:{torch.__version__}:{cpu}:{flags}".encode())
    return digest.hexdigest()[:16]


def build_directory(name: str, sources: list[str]) -> Path:
    """Where module `name` built from csrc/`sources` lives in the cache: one directory per build key."""
    return default_cache_dir() / "kernels" / f"{name}-{_build_key([_SOURCES / source for source in sources])}"


def _source_copy(build_dir: Path, sources: list[Path]) -> list[Path]:
    """The sources and headers copied into the build directory, once: the build reads them from there, so its
    paths are the same from every checkout (torch rebuilds a module whose source paths changed)."""
    copies = build_dir / "src"
    copies.mkdir(exist_ok=True)
    for path in sources + sorted(_SOURCES.glob("*.h")):
        copy = copies / path.name
        if not copy.exists() or copy.read_bytes() != path.read_bytes():
            copy.write_bytes(path.read_bytes())
    return [copies / path.name for path in sources]


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One builder per build directory, by an OS file lock that dies with its process.

    torch marks a build in progress with a `lock` file and makes every other loader wait, forever, until it is gone;
    a build killed midway (Ctrl-C on a first `loom serve`) leaves it behind and every later start hangs. Under this
    lock no other Loom process is building, so a `lock` file found here is such a leftover and is removed.
    """
    with open(build_dir / "loom.lock", "w") as handle:  # closing it releases the lock
        fcntl.flock(handle, fcntl.LOCK_EX)
        leftover = build_dir / "lock"
        if leftover.exists():
            log.warning("removing %s, left by a build that did not finish", leftover)
            leftover.unlink()
        yield


def _load(name: str, sources: list[str], verbose: bool) -> ModuleType | None:
    """Compile csrc/`sources` as module `name` (or find it built), or None with a warning if it cannot be built."""
    from torch.utils import cpp_extension

    paths = [_SOURCES / source for source in sources]
    build_dir = build_directory(name, sources)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            return cpp_extension.load(
                name=name,
                sources=[str(path) for path in _source_copy(build_dir, paths)],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=verbose,
            )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler, no ninja, a failed build
        log.warning("C++ kernel %s unavailable (%s); using torch ops instead", name, exc)
        return None


def kernel_for(option: str, choice: str, insisted: str, load: Callable[[], ModuleType | None]) -> ModuleType | None:
    """The kernel that `option=choice` ('auto' or `insisted`) asks for, or None where it cannot be built here;
    a clear error instead when the choice is `insisted`, which demands the kernel."""
    kernel = load()
    if kernel is None and choice == insisted:
        raise RuntimeError(f"{option}={insisted!r} needs the C++ kernel, which failed to build or cannot run on this "
                           "CPU (see the log)")
    return kernel


def load_paged_attention(verbose: bool = False) -> ModuleType | None:
    """The compiled `write_kv` / `decode_attention` / `prefill_attention` module, or None if it cannot be built here."""
    return _load("loom_paged_attention",
                 ["paged_attention.cpp", "prefill_attention.cpp", "prefill_attention_amx.cpp", "write_kv.cpp"], verbose)


def load_windowed_attention(verbose: bool = False) -> ModuleType | None:
    """The compiled `windowed_attention` module (sliding-window layers), or None if it cannot be built here."""
    return _load("loom_windowed_attention", ["windowed_attention.cpp"], verbose)


def load_packed_linear(verbose: bool = False) -> ModuleType | None:
    """The compiled `packed_linear` module, or None if it cannot be built here."""
    return _load("loom_packed_linear", ["packed_linear.cpp"], verbose)


def load_quantized_linear(verbose: bool = False) -> ModuleType | None:
    """The compiled `quantized_linear` module (GGUF Q4_0 / Q4_1 / Q8_0 weights), or None if it cannot be built here."""
    return _load("loom_quantized_linear", ["quantized_linear.cpp"], verbose)


def load_amx_linear(verbose: bool = False) -> ModuleType | None:
    """The compiled `amx_linear` module (bfloat16 matmuls on AMX tiles), or None on a CPU without AMX-BF16 (not even
    compiled there) or where Linux does not grant this process the tile state."""
    if not {"amx_tile", "amx_bf16"} <= cpu_flags():
        log.info("no AMX-BF16 on this CPU: the AMX linear kernel is not built")
        return None
    module = _load("loom_amx_linear", ["amx_linear.cpp"], verbose)
    if module is not None and not module.amx_available():
        log.warning("the CPU has AMX but Linux did not grant this process its tile state; using other matmuls")
        return None
    return module


def load_layer_loop(verbose: bool = False) -> ModuleType | None:
    """The compiled `LayerLoop` module (a Llama model's layers in one call, calling the other kernels' modules through
    the entry points they export), or None if it cannot be built here."""
    return _load("loom_layer_loop", ["layer_loop.cpp"], verbose)


def load_layer_ops(verbose: bool = False) -> ModuleType | None:
    """The compiled `add_rms_norm` / `rotary_` / `silu_mul` module, or None if it cannot be built here."""
    return _load("loom_layer_ops", ["layer_ops.cpp"], verbose)


def load_argmax(verbose: bool = False) -> ModuleType | None:
    """The compiled `argmax_rows` module (greedy sampling), or None if it cannot be built here."""
    return _load("loom_argmax", ["argmax.cpp"], verbose)


def build() -> None:
    """Compile (or find cached) every kernel now and say whether it is usable; `make install` calls this."""
    logging.basicConfig(level=logging.INFO)
    attention = load_paged_attention()
    print("loom paged attention kernel:", "ready" if attention else "unavailable (torch SDPA will be used)")
    windowed = load_windowed_attention()
    print("loom sliding-window attention kernel:", "ready" if windowed else "unavailable (torch SDPA will be used)")
    linear = load_packed_linear()
    print("loom packed linear kernel:", "ready" if linear else "unavailable (torch matmuls will be used)")
    quantized = load_quantized_linear()
    print("loom quantized linear kernel:", "ready" if quantized else "unavailable (weights will be dequantized)")
    amx = load_amx_linear()
    print("loom AMX linear kernel:", "ready" if amx else "unavailable (no AMX-BF16: bfloat16 uses the other kernels)")
    layer_ops = load_layer_ops()
    print("loom fused layer ops:", "ready" if layer_ops else "unavailable (torch ops will be used)")
    argmax = load_argmax()
    print("loom greedy argmax:", "ready" if argmax else "unavailable (torch's argmax will be used)")
    layer_loop = load_layer_loop()
    print("loom layer loop:", "ready" if layer_loop else "unavailable (the layers run from Python)")
