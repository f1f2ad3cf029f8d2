"""compose.yaml: valid Compose, and every service runs a command, a configuration and a health
check that the app understands, with secrets from the env file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.deploy.conftest import REPO, SHARED, health_url, url_port_and_path
from tests.deploy.dockerignore import dockerignore_excludes, dockerignore_patterns
from tests.deploy.settings_check import load_as_container, read_env_file

COMPOSE_SCHEMA = SHARED / "reference" / "compose-spec" / "compose-spec.json"
SECRET = re.compile(r"KEY|SECRET|TOKEN|PASSWORD", re.IGNORECASE)


def _services(compose) -> dict[str, dict]:
    return compose["services"]


def _gateways(compose) -> dict[str, dict]:
    """The services that run `seqgate serve` (the others are the Ray profile's nodes)."""
    return {n: s for n, s in _services(compose).items() if s["command"][0] == "seqgate"}


def _ray_nodes(compose) -> dict[str, dict]:
    return {n: s for n, s in _services(compose).items() if s["command"][0] == "ray"}


def _bind_mounts(service: dict) -> dict[str, tuple[str, str]]:
    """Container path -> (repository path, mode), for the service's bind mounts (short syntax)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        if source.startswith("."):
            mounts[target] = (source, mode[0] if mode else "rw")
    return mounts


def _env_files(service: dict) -> list:
    files = service.get("env_file", [])
    files = [files] if isinstance(files, str | dict) else files
    return [f["path"] if isinstance(f, dict) else f for f in files]


def _container_env(service: dict, runtime_env: dict[str, str]) -> dict[str, str]:
    """The environment a container of this service starts with: the image's ENV, the env files
    (their committed `.example` where the real one is the user's to write), then `environment`."""
    env = dict(runtime_env)
    for name in _env_files(service):
        path = REPO / name
        path = path if path.is_file() else path.with_name(path.name + ".example")
        assert path.is_file(), f"{name} (or {name}.example) is missing"
        env.update(read_env_file(path))
    env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
    return env


def _seconds(duration: str | int) -> float:
    if isinstance(duration, int | float):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_file_follows_the_compose_spec(compose):
    if not COMPOSE_SCHEMA.is_file():
        pytest.skip(f"Compose schema not found at {COMPOSE_SCHEMA} (the shared/ folder that sits "
                    "beside the checkout)")
    from jsonschema import Draft7Validator

    errors = Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text())).iter_errors(compose)
    assert [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors] == []


def test_services_build_this_dockerfile_with_arguments_it_declares(compose, stages):
    declared = {c.value[0].split("=")[0] for s in stages for c in s.all("ARG")}
    for name, service in _services(compose).items():
        assert service["build"]["context"] == ".", name
        assert set(service["build"].get("args", {})) <= declared, name


@pytest.mark.parametrize("name", ["seqgate", "seqgate-replica", "seqgate-gpu", "seqgate-ray"])
def test_service_starts_with_settings_the_app_understands(name, compose, runtime, cli):
    """Command flags, the mounted serving.properties and every SEQGATE_* variable load without a
    single warning or error from app/settings.py, and the server listens where the ports point."""
    service = _services(compose)[name]
    args = cli.parse_args(service["command"][1:])
    assert service["command"][0] == "seqgate"
    mounts = _bind_mounts(service)
    assert args.config in mounts, f"{name}: --config {args.config} is not a mounted file"
    source, mode = mounts[args.config]
    assert mode == "ro", f"{name}: mount {source} read-only"
    settings, warnings = load_as_container(args, _container_env(service, runtime.env()),
                                           config=REPO / source)
    assert warnings == []
    assert settings.server.host == "0.0.0.0"
    container_ports = {p.split(":")[-1] for p in service["ports"]}
    assert container_ports == {str(settings.server.port)}


def test_the_settings_check_hears_what_the_settings_code_says(runtime, cli, tmp_path):
    """Not vacuous: an unknown variable or key is reported, an invalid value stops loading."""
    props = tmp_path / "serving.properties"
    props.write_text("option.max_splits=2\noption.not_a_key=1\n")
    env = {**runtime.env(), "SEQGATE_NOT_A_SETTING": "1"}
    settings, warnings = load_as_container(cli.parse_args(["serve"]), env, config=props)
    assert settings.engine.max_splits == 2
    assert len(warnings) == 2 and "SEQGATE_NOT_A_SETTING" in " ".join(warnings)
    from app.settings import SettingsError

    with pytest.raises(SettingsError, match="SEQGATE_DRAIN_TIMEOUT"):
        load_as_container(cli.parse_args(["serve"]), {"SEQGATE_DRAIN_TIMEOUT": "soon"})


def test_api_keys_come_from_the_env_file_not_compose(compose):
    for name, service in _services(compose).items():
        inline = [k for k in (service.get("environment") or {}) if SECRET.search(k)]
        assert inline == [], f"{name}: secrets inline in compose.yaml"
        assert "deploy/seqgate.env" in _env_files(service), name
    example = read_env_file(REPO / "deploy" / "seqgate.env.example")
    assert example.get("SEQGATE_API_KEYS"), "the example env file shows where API keys go"


def test_the_real_env_file_stays_out_of_git_and_the_image():
    assert dockerignore_excludes("deploy/seqgate.env", dockerignore_patterns())
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/seqgate.env"], cwd=REPO)
    assert ignored.returncode == 0, "add deploy/seqgate.env to .gitignore"


def test_health_check_is_the_images_and_asks_a_route_the_app_serves(compose, runtime, routes,
                                                                     cli):
    image_check = list(runtime.last("HEALTHCHECK").value)
    assert set(_gateways(compose)) | set(_ray_nodes(compose)) == set(_services(compose))
    for name, service in _gateways(compose).items():
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:] == image_check[1:], name
        port, path = url_port_and_path(health_url(test))
        assert ("GET", path) in routes
        assert str(port) == cli.parse_args(service["command"][1:]).port


def test_model_cache_volume_is_the_images(compose, runtime):
    cache = runtime.env()["SEQGATE_CACHE_DIR"]
    declared = set(compose.get("volumes", {}))
    for name, service in _services(compose).items():
        named = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]
                 if not v.startswith((".", "/"))}
        assert cache in named, f"{name}: no named volume at {cache}"
        assert named[cache] in declared, f"{name}: volume {named[cache]} is not declared"
    per_service = [s["volumes"] for s in _services(compose).values()]
    caches = [v.split(":")[0] for vols in per_service for v in vols if v.endswith(cache)]
    assert len(caches) == len(set(caches)), "two services writing one cache volume"


def test_drain_finishes_before_docker_kills(compose, runtime):
    for name, service in _services(compose).items():
        env = _container_env(service, runtime.env())
        drain = float(env["SEQGATE_DRAIN_TIMEOUT"])
        assert service["stop_signal"] == runtime.last("STOPSIGNAL").value[0] == "SIGTERM"
        assert drain < _seconds(service["stop_grace_period"]), name
        assert service["restart"] == "unless-stopped", name


def test_gpu_profile_reserves_nvidia_devices_for_the_cuda_image(compose):
    gpu = [s for s in _services(compose).values() if "gpu" in s.get("profiles", [])]
    assert len(gpu) == 1
    (service,) = gpu
    assert service["build"]["args"]["TORCH_VARIANT"] == "cuda"
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_replica_runs_beside_the_main_service_on_a_shared_network(compose):
    services = _services(compose)
    main, replica = services["seqgate"], services["seqgate-replica"]
    assert replica["image"] == main["image"] and replica["command"] == main["command"]
    assert set(replica["networks"]) & set(main["networks"])
    host_ports = [p.split(":")[0] for s in services.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), "two services publish one host port"


def test_the_ray_profile_runs_a_head_workers_and_a_gateway_from_one_image(compose, cli):
    """One image (built with the ray extra) for the head, the workers and the gateway; the
    gateway and the workers find the head where it listens; the gateway serves replicas."""
    services = _services(compose)
    ray_services = {n: s for n, s in services.items() if "ray" in s.get("profiles", [])}
    assert set(ray_services) == {"seqgate-ray", "ray-head", "ray-worker"}
    assert len({s["image"] for s in ray_services.values()}) == 1
    assert all(s["build"]["args"]["SEQGATE_EXTRAS"] == "ray" for s in ray_services.values())
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(r.startswith("ray[serve]==") for r in extras["ray"])
    head = services["ray-head"]["command"]
    assert head[:3] == ["ray", "start", "--head"] and "--block" in head
    head_address = f"ray-head:{head[head.index('--port') + 1]}"
    worker = services["ray-worker"]["command"]
    assert worker[worker.index("--address") + 1] == head_address and "--block" in worker
    gateway = services["seqgate-ray"]
    assert gateway["environment"]["RAY_ADDRESS"] == head_address
    assert int(cli.parse_args(gateway["command"][1:]).replicas) >= 2
    for name, node in _ray_nodes(compose).items():
        assert node["healthcheck"]["test"][1:3] == ["ray", "health-check"], name
