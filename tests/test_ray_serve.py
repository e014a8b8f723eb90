"""Loom on Ray Serve: a two-node cluster on this machine (head and one added node, 1 CPU each), two replicas of the
bundled model, one a node, behind the OpenAI app of `loom serve`."""

from __future__ import annotations

import random
import re
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ray.cluster_utils import Cluster  # noqa: E402

from loom import LLM, SamplingParams  # noqa: E402
from loom.bench.serve_client import free_loopback_port  # noqa: E402
from loom.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from loom.distributed.launch import start_replicas  # noqa: E402
from loom.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(dtype="float32", scheduler=SchedulerConfig(16, 256), cache=CacheConfig(num_kv_blocks=512))


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 200 << 20,
                                                           "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=200 << 20)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@contextmanager
def endpoint(router: str):
    """Two replicas with `router`, and the OpenAI app over them on a free port."""
    import uvicorn

    client = start_replicas(CONFIG, replicas=2, threads=1, router=router, max_replicas_per_node=1)
    server = uvicorn.Server(uvicorn.Config(create_app(client, "smol"), host="127.0.0.1", port=free_loopback_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}", client
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        serve.delete(client.app_name)


def replica_metric(base: str, name: str) -> dict[str, float]:
    """Each replica's value of a metric, from the endpoint's /metrics (replicas post every second)."""
    text = httpx.get(base + "/metrics", timeout=10).text
    values = {}
    for match in re.finditer(rf'^{name}{{replica="([^"]+)"}} ([0-9.e+]+)$', text, re.M):
        values[match.group(1)] = float(match.group(2))
    return values


def routed_counts(base: str, by: str = "routed_by") -> dict[str, float]:
    """The endpoint's routing counters summed by why the router chose the replica, or by replica."""
    text = httpx.get(base + "/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for match in re.finditer(r'^loom_router_requests_total{replica="([^"]+)",routed_by="([a-z]+)"} ([0-9.e+]+)$',
                             text, re.M):
        key = match.group(1) if by == "replica" else match.group(2)
        counts[key] = counts.get(key, 0.0) + float(match.group(3))
    return counts


def test_outputs_equal_one_engine_and_bad_input_never_reaches_a_replica(cluster, smollm2):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.text for o in LLM(dtype="float32", loaded=smollm2, num_kv_blocks=512).generate(prompts, params)]
    with endpoint("prefix") as (base, _):
        for prompt, text in zip(prompts, expected):
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            assert httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == text
            with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            assert "".join(httpx.Response(200, content=c[6:]).json()["choices"][0]["text"] for c in chunks) == text
        chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 12, "temperature": 0}
        local = LLM(dtype="float32", loaded=smollm2, num_kv_blocks=512)
        ids = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(
            chat["messages"], add_generation_prompt=True), add_special_tokens=False)
        want = local.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0].text
        assert httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0][
            "message"]["content"] == want

        time.sleep(2.5)
        before = replica_metric(base, "loom_prompt_tokens_total")
        for body in ({"prompt": "x", "max_tokens": 100000}, {"prompt": [999999], "max_tokens": 4},
                     {"prompt": "x", "temperature": -1}, {"prompt": "x", "response_format": {"type": "json_schema",
                                                                                           "json_schema": {}}}):
            answer = httpx.post(base + "/v1/completions", json=body, timeout=30)
            assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
        time.sleep(2.5)
        assert replica_metric(base, "loom_prompt_tokens_total") == before and len(before) == 2


@pytest.mark.parametrize("router", ["prefix", "round_robin"])
def test_prefix_routing_keeps_each_tenant_on_one_replica(cluster, smollm2, router):
    tokenizer = smollm2.tokenizer
    rng = random.Random(0)
    words = tokenizer.decode(list(range(1000, 1600)))
    systems = [tokenizer.encode(f"Tenant {t}. " + words)[:300] for t in range(4)]
    order = [t for t in range(4) for _ in range(8)]
    rng.shuffle(order)
    with endpoint(router) as (base, _):
        routed_before = routed_counts(base)
        for k, tenant in enumerate(order):
            body = {"prompt": systems[tenant] + tokenizer.encode(f" Question {k}?"), "max_tokens": 2,
                    "temperature": 0}
            assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        time.sleep(2.5)
        hits = sum(replica_metric(base, "loom_prefix_cache_hits").values())
        routed = {reason: n - routed_before.get(reason, 0.0) for reason, n in routed_counts(base).items()}
    shared = 300 // 16 * 16  # the tokens of a system prompt's full blocks
    if router == "prefix":  # every request after a tenant's first finds its whole system prompt cached
        assert hits == 4 * 7 * shared
        assert routed == {"load": 4, "prefix": 28}  # a tenant's first request goes to the least loaded
    else:  # each tenant's first request on each replica misses
        assert hits < 4 * 7 * shared
        assert routed == {"turn": 32}


def test_round_robin_alternates_requests_that_arrive_together(cluster):
    with endpoint("round_robin") as (base, _):
        before = routed_counts(base, by="replica")

        def complete(k: int) -> None:
            body = {"prompt": f"Request {k}", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200

        threads = [threading.Thread(target=complete, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        after = routed_counts(base, by="replica")
    sent = [n - before.get(replica, 0.0) for replica, n in after.items()]  # an earlier app's replicas stay listed
    assert sorted(n for n in sent if n) == [4, 4]


def test_a_disconnect_frees_the_requests_blocks_on_its_replica(cluster):
    with endpoint("prefix") as (base, _):
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for _ in zip(range(3), r.iter_lines()):
                pass
        deadline = time.time() + 20
        used = None
        while time.time() < deadline:
            time.sleep(1.0)
            used = replica_metric(base, "loom_kv_blocks_used")
            if len(used) == 2 and not any(used.values()):
                break
        assert used is not None and len(used) == 2 and not any(used.values())


def test_a_killed_replica_fails_its_requests_cleanly_and_comes_back(cluster):
    with endpoint("round_robin") as (base, client):
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True}
        results: dict[int, list[str]] = {}

        def stream(index: int) -> None:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                results[index] = [line for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]  # one on each replica
        for t in threads:
            t.start()
        time.sleep(3)
        running = replica_metric(base, "loom_requests_running")  # replicas post their ids with their metrics
        victim = max(running, key=running.get)
        # Serve's own name for a replica actor (the dashboard's state API, off here, would list it).
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{client.app_name}#loom-engine#{victim}", namespace="serve"),
                 no_restart=True)
        for t in threads:
            t.join(timeout=120)
        failed = [lines[-2].startswith('data: {"error"') for lines in results.values()]
        assert running[victim] == failed.count(True) >= 1  # the victim's streams end with an error event
        assert all(lines[-1] == "data: [DONE]" for lines in results.values())  # and every stream ends
        after = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert after.status_code == 200 and httpx.get(base + "/health", timeout=10).status_code == 200
        deadline = time.time() + 90
        while client.ready_replicas < 2 and time.time() < deadline:
            time.sleep(1)
        assert client.ready_replicas == 2
        health = {}
        while health.get("replicas_ready") != 2 and time.time() < deadline + 30:  # Serve's status settles
            time.sleep(1.1)
            health = httpx.get(base + "/health", timeout=10).json()
        assert health == {"status": "ok", "replicas_ready": 2}


def test_the_cli_router_names_are_the_routers():
    from loom.cli import ROUTER_NAMES
    from loom.distributed.router import ROUTERS

    assert set(ROUTER_NAMES) == set(ROUTERS)
