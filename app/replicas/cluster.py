"""Bring up (and take down) the engine replicas on Ray Serve for `seqgate serve --replicas N`.

`connect_ray` starts a local Ray instance, or joins the cluster named by `RAY_ADDRESS` (`auto`:
the one this machine belongs to); it runs on the main thread before the HTTP server starts.
`deploy_replicas` then deploys `EngineReplica` as the Ray Serve application `seqgate` (no Ray
HTTP proxy: the seqgate process serves HTTP) with our request router, and returns the
RemoteEngine the gateway uses. Every engine setting applies to every replica.

Stopping: RemoteEngine.stop drains this gateway's jobs, then `teardown` deletes the application
(Ray lets each replica finish its open calls, up to the drain timeout) and, when this process
started Ray, stops it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import ray
import torch
from ray import serve
from ray.serve.config import AutoscalingConfig, HTTPOptions, RequestRouterConfig

from app.replicas.deployment import EngineReplica
from app.replicas.remote_engine import RemoteEngine
from app.replicas.router import SeqgateRouter
from app.settings import Settings, SettingsError
from engine import EngineConfig

log = logging.getLogger("seqgate.replicas")

APP_NAME = "seqgate"
DEPLOYMENT_NAME = "engine"
# How often each replica reports its queue, load and cache counters to the routers (and so to
# /health and /metrics): Ray's default, 10 s, is too stale to balance load by.
ROUTING_STATS_PERIOD_S = 0.5
# Time for a replica to load its model before Ray gives up on it.
DESCRIBE_TIMEOUT_S = 60.0


def connect_ray() -> bool:
    """Join RAY_ADDRESS's cluster or start a local one; True when this process started it."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, configure_logging=False)
    else:
        ray.init(include_dashboard=False, configure_logging=False)
    log.info("Ray %s: %s", "joined" if address else "started locally",
             ray.get_runtime_context().gcs_address)
    return address is None


def replica_engine_config(settings: Settings) -> EngineConfig:
    """The engine settings each replica runs: the configured ones, with torch threads sized to
    the replica's CPUs when they were left to the default (the cores of the whole machine)."""
    cfg = settings.engine
    cpus = settings.replicas.replica_cpus
    if cfg.num_threads == 0 and cpus >= 1:
        cfg = dataclasses.replace(cfg, num_threads=int(cpus))
    if cfg.device.startswith("cuda:"):  # Ray shows each replica only its own GPU, as cuda:0
        cfg = dataclasses.replace(cfg, device="cuda")
    return cfg


def runs_on_cuda(engine: EngineConfig) -> bool:
    """True when the replicas' engines run on CUDA: as the device says, or `auto` where this
    process sees CUDA (Ray hides the GPUs from a replica that does not reserve one)."""
    return engine.device.startswith("cuda") or (engine.device == "auto"
                                                and torch.cuda.is_available())


def visible_gpus() -> int:
    """The GPUs replicas can be placed on: the Ray cluster's once joined, else this machine's."""
    if ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    return torch.cuda.device_count()


def replica_gpus(settings: Settings) -> float:
    """Ray GPUs per replica: none on the CPU, else --replica-gpus, else one GPU each.

    A replica drives one device: tensor_parallel_degree > 1 (NCCL ranks, k GPUs each) is refused
    with replicas by load_settings, so it never asks for more than one GPU."""
    r = settings.replicas
    if not runs_on_cuda(settings.engine):
        if r.replica_gpus:
            log.warning("--replica-gpus=%g ignored: the replicas run on the CPU (--device=%s)",
                        r.replica_gpus, settings.engine.device)
        return 0.0
    share = r.replica_gpus or 1.0
    check_gpus(settings, share, visible_gpus())
    return share


def check_gpus(settings: Settings, share: float, gpus: int) -> None:
    """Refuse starting replicas that the GPUs cannot hold (Ray would leave them pending and the
    deploy waiting); autoscaled ones beyond them wait for a GPU, as Ray Serve does."""
    n, device = settings.replicas.replicas, settings.engine.device
    if gpus == 0:
        raise SettingsError(f"--device={device} runs the replicas on CUDA, but no GPU is "
                            "visible (Ray's cluster, or this machine): expected at least one")
    per_gpu = math.floor(1 / share + 1e-9)  # Ray packs the replicas whose shares fit in a GPU
    if math.ceil(n / per_gpu) <= gpus:
        return
    # Refused, not shared: a fraction is the user's memory call, as Ray Serve's num_gpus for vLLM.
    fit = math.floor(1e4 / math.ceil(n / gpus)) / 1e4  # Ray counts GPU shares to 4 decimals
    given = f" with --replica-gpus={share:g}" if settings.replicas.replica_gpus else ""
    raise SettingsError(f"--replicas={n}{given} needs {math.ceil(n / per_gpu)} GPUs, {gpus} "
                        f"visible: expected at most {gpus * per_gpu} replicas, or "
                        f"--replica-gpus={fit:g} to share the GPUs (each replica then holds its "
                        "own weights and KV cache in a part of one)")


def deployment_options(settings: Settings) -> dict[str, Any]:
    """Ray Serve's options for the replicas' deployment (also read by the docs' example)."""
    r, engine = settings.replicas, settings.engine
    batch = engine.batch_rows  # auto on CUDA: the replicas derive more from their KV budget
    actor: dict[str, Any] = {"num_cpus": r.replica_cpus}
    if gpus := replica_gpus(settings):
        actor["num_gpus"] = gpus
    options: dict[str, Any] = dict(
        name=DEPLOYMENT_NAME,
        # The engine's own queue refuses first (429): Ray only caps what a replica is sent.
        max_ongoing_requests=2 * (batch + engine.job_queue_size),
        ray_actor_options=actor,
        graceful_shutdown_timeout_s=max(settings.server.drain_timeout, 1.0),
        graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2.0,
        request_router_config=RequestRouterConfig(
            request_router_class=SeqgateRouter,
            request_router_kwargs={"policy": r.router,
                                   "imbalance_tokens": r.router_imbalance_tokens},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    )
    if r.max_replicas > r.replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=r.min_replicas or r.replicas, initial_replicas=r.replicas,
            max_replicas=r.max_replicas, target_ongoing_requests=batch + r.target_queue_depth)
    else:
        options["num_replicas"] = r.replicas
    return options


def deploy_replicas(settings: Settings, started_ray: bool) -> RemoteEngine:
    """Deploy the replicas, wait until one answers, and return the gateway's engine."""
    serve.start(http_options=HTTPOptions(location="NoServer"))
    deployment = serve.deployment(EngineReplica).options(**deployment_options(settings))
    app = deployment.bind(replica_engine_config(settings), settings.server.drain_timeout)
    handle = serve.run(app, name=APP_NAME, route_prefix=None)
    info = handle.describe.remote().result(timeout_s=DESCRIBE_TIMEOUT_S)
    log.info("%d replica(s) of %s, router %s", settings.replicas.replicas, info.name,
             settings.replicas.router)

    def teardown() -> None:
        try:
            serve.delete(APP_NAME)
            if started_ray:
                serve.shutdown()
                ray.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway; say why it was not clean
            log.exception("stopping the replicas failed")

    return RemoteEngine(settings.engine, handle, info, on_stop=teardown)
