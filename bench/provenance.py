"""Where and with what a benchmark ran: the machine, the versions, the commit and the command."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction sets that decide which CPU paths run (a figure is comparable only with others
# taken on the same ones).
ISA_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_isa() -> list[str]:
    """Which of ISA_FLAGS this CPU has (/proc/cpuinfo; [] where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [flag for flag in ISA_FLAGS if flag in flags]
    except OSError:
        pass
    return []


def machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "isa": cpu_isa(),
        "cores_available": cores,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit_of(checkout: Path) -> str:
    """Another checkout's short commit (`--checkout DIR` of the benchmarks), or "?"."""
    return _git("-C", str(checkout), "rev-parse", "--short", "HEAD") or "?"


def versions() -> dict:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "fastapi": version("fastapi"),
        "httpx": version("httpx"),
        "seqgate": version("seqgate"),
        "seqgate_git_sha": _git("rev-parse", "HEAD"),
        "seqgate_git_dirty": bool(dirty) if dirty is not None else None,
    }


def command(argv: list[str] | None = None, module: str = "bench.serving") -> str:
    """The command line that reruns this benchmark from the repository root."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", module, *args])


def jsonable(args) -> dict:
    """Parsed flags (a Namespace or a dict) as JSON-ready values: paths as strings."""
    items = args if isinstance(args, dict) else vars(args)
    return {k: str(v) if isinstance(v, Path) else v for k, v in items.items()}


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def meta(argv: list[str] | None, module: str, args=None, *, command_line: str | None = None,
         started: bool = False, versions_too: bool = True, finished: bool = True) -> dict:
    """A results file's `meta` block, in this order: the command (`command_line`, else the one
    that reruns `module` with `argv`), when it started (with `started`), the machine, the
    versions (with `versions_too`), the flags (`args`: a Namespace or a dict, paths as strings)
    and when it finished (with `finished`; otherwise the caller adds it at the end)."""
    out: dict = {"command": command_line or command(argv, module)}
    if started:
        out["started"] = now()
    out["machine"] = machine()
    if versions_too:
        out["versions"] = versions()
    if args is not None:
        out["args"] = jsonable(args)
    if finished:
        out["finished"] = now()
    return out
