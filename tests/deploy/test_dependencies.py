"""The declared dependencies say what the server needs: every third-party module the installed
packages import is declared, and every declared runtime dependency has a use."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OURS = {"app", "engine", "adapters", "openapi", "bench"}
# Runtime dependencies that no module of ours imports, and why they are needed all the same.
USED_THROUGH_OTHERS = {
    "accelerate": "transformers needs it to load GGUF checkpoints",
    "gguf": "transformers reads the embedded model's GGUF file with it",
    "safetensors": "the de-quantised GGUF cache is written and read as safetensors",
    "jinja2": "transformers renders chat templates with it, without declaring it",
    "tiktoken": "transformers reads tiktoken.model tokenizer files with it "
                "(tests/engine/test_loader.py)",
    "tokenizers": "transformers' fast tokenizers; DecodeStream for incremental detokenizing",
    "ninja": "torch.utils.cpp_extension builds our kernels (engine/kernels/csrc) "
             "(engine/kernels/native.py)",
}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _imports(package_dirs: list[Path]) -> dict[str, set[str]]:
    """Top-level module -> the files importing it (imports inside functions included)."""
    found: dict[str, set[str]] = {}
    for root in package_dirs:
        for path in root.rglob("*.py"):
            if "checks" in path.relative_to(REPO).parts:
                continue  # openapi/checks: development tools, not installed
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(
                        str(path.relative_to(REPO)))
    return found


def _distributions(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    owners = packages_distributions()
    out: dict[str, set[str]] = {}
    for module, files in modules.items():
        if module in OURS or module in sys.stdlib_module_names:
            continue
        for dist in owners.get(module, [module]):
            out.setdefault(dist.lower().replace("_", "-"), set()).update(files)
    return out


# Optional extras, and the one package of ours that may import each (nothing else may).
EXTRA_USERS = {"ray": "app/replicas/", "embeddings": "app/embeddings/"}


def test_the_server_imports_only_declared_dependencies():
    project = _project()
    runtime = {_name(r) for r in project["dependencies"]}
    used = _distributions(_imports([REPO / p for p in ("app", "engine", "adapters", "openapi")]))
    undeclared = {}
    for dist, files in used.items():
        if dist in runtime:
            continue
        extras = {extra for extra, where in EXTRA_USERS.items()
                  if dist in {_name(r) for r in project["optional-dependencies"][extra]}
                  and all(f.startswith(where) for f in files)}
        if not extras:
            undeclared[dist] = sorted(files)
    assert not undeclared, f"imported but not in [project].dependencies: {undeclared}"


def test_the_server_starts_without_the_optional_extras():
    """Importing the app and the CLI imports no ray and no sentence-transformers: `--replicas 1`
    and a server without --embedding-model need nothing more."""
    code = ("import sys, app.__main__, app.factory, app.replicas.policy; "
            "sys.exit('ray' in sys.modules or 'sentence_transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_every_runtime_dependency_has_a_use():
    runtime = {_name(r) for r in _project()["dependencies"]}
    used = _distributions(_imports([REPO / p for p in ("app", "engine", "adapters", "openapi")]))
    unused = runtime - set(used) - set(USED_THROUGH_OTHERS)
    assert not unused, f"declared but never imported (and no reason given): {sorted(unused)}"


# Imported by a benchmark only when installed by hand, and left undeclared on purpose.
BENCH_OPTIONAL = {
    "xgrammar": "bench.studies.grammar_libs compares it with llguidance when it is installed; "
                "it pulls triton (1 GB), too much for every `make bench`",
    "openvino-genai": "bench.openvino_peer's driver runs in its own environment "
                      "(.venv-openvino, scripts/install_openvino.sh): optimum-intel pins its own "
                      "transformers",
    "openvino": "the same driver, beside openvino-genai",
}


def test_the_benchmarks_import_only_declared_dependencies():
    project = _project()
    allowed = {_name(r) for r in project["dependencies"] + project["optional-dependencies"][
        "bench"]} | set(BENCH_OPTIONAL)
    used = _distributions(_imports([REPO / "bench"]))
    undeclared = {d: sorted(f) for d, f in used.items() if d not in allowed}
    assert not undeclared, f"bench imports what the bench extra does not declare: {undeclared}"
