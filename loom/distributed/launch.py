"""`loom serve --replicas N`: engine replicas on Ray Serve (a local Ray instance, or the cluster at --ray-address)
behind the same OpenAI app as `loom serve`, served from this process."""

from __future__ import annotations

import dataclasses
import logging

import ray
from ray import serve
from ray.serve.config import ProxyLocation, RequestRouterConfig

from loom.config import EngineConfig
from loom.distributed.client import RayEngineClient
from loom.distributed.metrics_board import MetricsBoard
from loom.distributed.replica import LOOM_NAMESPACE, METRICS_BOARD, EngineReplica
from loom.distributed.router import ROUTERS

log = logging.getLogger("loom.server")
DEPLOYMENT_NAME = "loom-engine"


def default_threads_per_replica(replicas: int, max_replicas_per_node: int | None) -> int:
    """A node's cores divided by the replicas placed on it (the cluster's smallest node, evenly spread)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cores = min(int(n["Resources"].get("CPU", 1)) for n in nodes)
    per_node = -(-replicas // len(nodes))
    if max_replicas_per_node is not None:
        per_node = min(per_node, max_replicas_per_node)
    return max(1, cores // max(1, per_node))


def start_replicas(config: EngineConfig, replicas: int, threads: int, router: str,
                   max_replicas_per_node: int | None = None, max_waiting: int | None = None,
                   request_timeout: float | None = None) -> RayEngineClient:
    """Deploy `replicas` engine replicas of `threads` threads each on the connected Ray cluster; their client."""
    board = MetricsBoard.options(name=METRICS_BOARD, namespace=LOOM_NAMESPACE, get_if_exists=True).remote()
    serve.start(proxy_location=ProxyLocation.Disabled)  # this process serves the HTTP API itself
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT_NAME, num_replicas=replicas, max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": threads}, max_replicas_per_node=max_replicas_per_node,
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[router],
                                                  request_routing_stats_period_s=1,
                                                  request_routing_stats_timeout_s=5))
    replica_config = dataclasses.replace(config, num_threads=threads)
    # An app per router: a process keeps one router per deployment it has held a handle to, so a second app under
    # the same name would be routed by the first one's router.
    app_name = f"loom-{router}"
    handle = serve.run(deployment.bind(replica_config, max_waiting, request_timeout), name=app_name,
                       route_prefix=None)
    info = handle.info.remote().result()
    log.info("%d replica(s) of %s, %d thread(s) each, router %s; engine: %s", replicas, info.model_name, threads,
             router, info.description)
    return RayEngineClient(handle, info, app_name, DEPLOYMENT_NAME, board)


def connect(address: str | None) -> None:
    """Join the cluster at `address` ("auto": the one `ray start` made here), or start a local instance."""
    if address is None:
        ray.init(include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
