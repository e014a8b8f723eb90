"""A `loom serve` that a benchmark starts on this machine, on a free loopback port, and stops when it is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loom.bench.serve_client import free_loopback_port, wait_until_healthy


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


@contextmanager
def local_server(model: str | None, flags: list[str],
                 timeout: float = 600) -> Iterator[tuple[str, subprocess.Popen, float]]:
    """`loom serve [model] FLAGS`: its URL, its process and the seconds it took to answer /health. Stopped with
    SIGTERM on the way out, and whatever is left under it (Ray's processes) killed."""
    port = free_loopback_port()
    command = [sys.executable, "-m", "loom.cli", "serve", *([model] if model else []), "--port", str(port), *flags]
    log = tempfile.TemporaryFile("w+")  # not a pipe: a server whose log fills an unread pipe stops
    began = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(base, timeout=timeout)
        except TimeoutError:
            log.seek(0)
            raise RuntimeError(f"loom serve {' '.join(flags)} did not come up: {log.read()[-2000:]}") from None
        yield base, server, time.perf_counter() - began
    finally:
        family = descendants(server.pid)
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        for pid in family[1:]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
