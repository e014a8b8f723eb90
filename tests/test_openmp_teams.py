"""`loom serve` keeps one OpenMP team: every parallel region starts from the engine thread.

A second team (the model built on one thread and stepped on another, or a worker thread that tokenizes or compiles
a grammar and runs a torch op) shares the cores with the first, and libgomp then sleeps at every barrier. The
server runs as users start it, in its own process, and serves every kind of request before its threads are counted.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

import httpx
import pytest
import torch

from loom.bench.openmp_census import parked_openmp_workers
from loom.bench.serve_client import free_loopback_port, wait_until_healthy

THREADS = 2


def _workload(base: str) -> None:
    """Every kind of request the server makes or serves, several at once."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    calls = [
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 24, "stream": True}),
        ("/v1/completions", {"prompt": "Once upon a time " * 20, "max_tokens": 16, "logprobs": 3, "echo": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 24,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "c", "schema": schema}}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 12,
                                  "stream": True, "temperature": 0.8, "seed": 1}),
        ("/tokenize", {"messages": [{"role": "user", "content": "Hello!"}]}),
        ("/detokenize", {"tokens": [1, 2, 3, 4]}),
    ]
    with httpx.Client(base_url=base, timeout=120) as client, concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda call: client.post(call[0], json=call[1]), calls * 2))
        assert client.get("/metrics").status_code == 200
    assert [r.status_code for r in responses] == [200] * len(responses), [r.text[:200] for r in responses]


@pytest.mark.slow
@pytest.mark.skipif(torch.get_num_threads() < 2 and (os.cpu_count() or 1) < 2, reason="needs two cores")
def test_loom_serve_runs_every_parallel_region_on_one_team(tmp_path):
    port = free_loopback_port()
    command = [sys.executable, "-m", "loom.cli", "serve", "--dtype", "float32", "--threads", str(THREADS),
               "--port", str(port), "--max-num-seqs", "8"]
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until_healthy(base, timeout=180)
            assert parked_openmp_workers(server.pid) == THREADS - 1  # the engine thread's team, from the warm-up
            _workload(base)
            assert parked_openmp_workers(server.pid) == THREADS - 1, (tmp_path / "serve.log").read_text()[-2000:]
        finally:
            server.terminate()
            server.wait(timeout=60)
