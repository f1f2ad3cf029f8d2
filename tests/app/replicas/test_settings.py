"""The replica settings: defaults, validation, and how they become Ray Serve's options."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from app.settings import SettingsError, load_settings
from tests.app.replicas.conftest import REPO


def test_one_replica_is_the_default_and_not_scale_out():
    settings = load_settings({}, env={})
    assert settings.replicas.replicas == 1 and not settings.replicas.enabled
    assert settings.replicas.router == "prefix_affinity"


def test_flags_and_environment_set_the_replicas():
    settings = load_settings({"replicas": "3", "router": "least_loaded"},
                             env={"SEQGATE_MAX_REPLICAS": "5", "SEQGATE_REPLICA_CPUS": "2"})
    r = settings.replicas
    assert (r.replicas, r.router, r.max_replicas, r.replica_cpus) == (3, "least_loaded", 5, 2.0)


@pytest.mark.parametrize(("flags", "message"), [
    ({"router": "nearest"}, "--router='nearest' is invalid: expected one of prefix_affinity"),
    ({"replicas": "0"}, "--replicas='0' is invalid: expected an integer >= 1"),
    ({"replicas": "3", "max_replicas": "2"}, "--max-replicas=2 is below --replicas=3"),
    ({"replicas": "2", "min_replicas": "3"}, "--min-replicas=3 is above --replicas=2"),
    ({"replica_gpus": "1.5"}, "--replica-gpus='1.5' is invalid: expected a number in [0.0, 1.0]"),
    ({"replica_gpus": "half"}, "--replica-gpus='half' is invalid: expected a number in"),
    ({"replicas": "2", "tensor_parallel_degree": "2"},
     "--tensor-parallel-degree=2 with replicas: .* not supported yet"),
])
def test_invalid_replica_settings_are_refused_by_name(flags, message):
    with pytest.raises(SettingsError, match=message.replace("[", r"\[")):
        load_settings(flags, env={})


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has CUDA with this many GPUs (the only thing mocked)."""
    def have(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return have


def test_deployment_options_map_the_settings_to_ray_serve(gpus):
    from app.replicas.cluster import deployment_options, replica_engine_config

    gpus(0)  # CPU replicas whatever this machine has
    fixed = load_settings({"replicas": "2", "max_rolling_batch_size": "8",
                           "job_queue_size": "4", "router": "round_robin"}, env={})
    opts = deployment_options(fixed)
    assert opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    assert opts["max_ongoing_requests"] == 2 * (8 + 4)  # the engine's queue refuses first
    assert opts["request_router_config"].request_router_kwargs["policy"] == "round_robin"
    assert replica_engine_config(fixed).num_threads == 1  # one per replica CPU

    scaling = load_settings({"replicas": "2", "min_replicas": "1", "max_replicas": "4",
                             "max_rolling_batch_size": "8", "target_queue_depth": "2"}, env={})
    auto = deployment_options(scaling)["autoscaling_config"]
    assert "num_replicas" not in deployment_options(scaling)
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas) == (1, 2, 4)
    assert auto.target_ongoing_requests == 8 + 2


def test_cuda_replicas_reserve_one_gpu_each(gpus):
    from app.replicas.cluster import deployment_options

    gpus(2)
    opts = deployment_options(load_settings({"replicas": "2"}, env={}))  # device auto
    assert opts["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_cpu_replicas_reserve_no_gpu(gpus):
    from app.replicas.cluster import deployment_options

    gpus(2)
    on_cpu = load_settings({"replicas": "2", "device": "cpu", "replica_gpus": "0.5"}, env={})
    assert "num_gpus" not in deployment_options(on_cpu)["ray_actor_options"]
    gpus(0)
    auto = load_settings({"replicas": "2"}, env={})
    assert deployment_options(auto)["ray_actor_options"] == {"num_cpus": 1.0}


def test_a_gpu_share_puts_several_replicas_on_a_gpu(gpus):
    from app.replicas.cluster import deployment_options, replica_engine_config

    gpus(2)
    shared = load_settings({"replicas": "4", "device": "cuda:1"},
                           env={"SEQGATE_REPLICA_GPUS": "0.5"})
    assert shared.replicas.replica_gpus == 0.5
    assert deployment_options(shared)["ray_actor_options"]["num_gpus"] == 0.5
    assert replica_engine_config(shared).device == "cuda"  # Ray picks each replica's GPU


@pytest.mark.parametrize(("count", "flags", "message"), [
    (2, {"replicas": "3"}, "--replicas=3 needs 3 GPUs, 2 visible: expected at most 2 replicas, "
                           "or --replica-gpus=0.5 to share the GPUs"),
    (2, {"replicas": "5", "replica_gpus": "0.5"},
     "--replicas=5 with --replica-gpus=0.5 needs 3 GPUs, 2 visible: expected at most 4 "
     "replicas, or --replica-gpus=0.3333"),
    (0, {"replicas": "2", "device": "cuda"}, "--device=cuda runs the replicas on CUDA, but no GPU"),
])
def test_more_cuda_replicas_than_the_gpus_hold_are_refused(gpus, count, flags, message):
    from app.replicas.cluster import deployment_options

    gpus(count)
    with pytest.raises(SettingsError, match=message.replace("[", r"\[")):
        deployment_options(load_settings(flags, env={}))


def test_replicas_without_the_ray_extra_stop_start_up_with_the_install_command():
    code = ("import sys; sys.modules['ray'] = None; from app.__main__ import main; "
            "sys.exit(main(['serve', '--replicas', '2', '--port', '0']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'seqgate[ray]'" in proc.stderr and "--replicas=2" in proc.stderr
