"""The servers under test: how to start each one, wait for it, measure its memory and stop it.

Every server runs as a child process on a free 127.0.0.1 port, on the CPU, serving the same local
safetensors copy of SmolLM2-135M-Instruct (the one seqgate's loader de-quantises the embedded GGUF
into), so both sides load the same weights:
  seqgate          `python -m app serve --model DIR --device cpu --port P [extra flags]`, in this
                   checkout (or `--checkout DIR`)
  transformers     `transformers serve DIR --device cpu --port P [--continuous-batching]`
  llama.cpp        `python -m bench.llamacpp_server --port P --parallel C` (xllamacpp, on the
                   GGUF that seqgate embeds, which seqgate de-quantises into DIR; one slot per
                   concurrent request, 2 threads)
  app              `python -m app serve --port P [extra flags]` with its own defaults (the
                   embedded model), run in a checkout (this one, or an older commit's worktree):
                   the scheduler scenarios (bench/stall.py, bench/structured.py)
The peer pins DIR as its FORCE_MODEL: requests must name exactly DIR (or no model), its
/v1/models answers 500 without a hub cache, so readiness is polled on /health, which only answers
once the forced model is loaded. Stop: SIGTERM, then SIGKILL after a timeout. Memory: the peak RSS
of the process tree (VmHWM, the kernel's high-water mark, summed over the tree) and the largest
RSS sampled while a workload runs (which leaves out the peak of loading the model).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration: its label in the results and how to launch it."""

    label: str  # e.g. "seqgate", "tf-serve", "tf-serve-cb", "seqgate cache off"
    kind: str  # "seqgate" | "transformers" | "llamacpp" | "app"
    extra_args: tuple[str, ...] = ()
    ready_path: str = "/health"
    # seqgate from another checkout (`python -m app serve` run there, this interpreter): an
    # older commit measured beside this one. None: this checkout's. Not the `seqgate` script:
    # an editable install runs the code of the checkout it was installed from, which a
    # benchmark run from a worktree of a fixed commit would then not measure.
    checkout: Path | None = None

    def argv(self, model_dir: Path, port: int) -> list[str]:
        if self.kind == "seqgate":
            return [sys.executable, "-m", "app", "serve", "--model", str(model_dir),
                    "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                    *(a.replace("{model}", str(model_dir)) for a in self.extra_args)]
        if self.kind == "transformers":
            return [_venv_script("transformers"), "serve", str(model_dir), "--device", "cpu",
                    "--host", "127.0.0.1", "--port", str(port), *self.extra_args]
        if self.kind == "llamacpp":
            return [sys.executable, "-m", "bench.llamacpp_server", "--port", str(port),
                    *self.extra_args]
        if self.kind == "app":
            return [sys.executable, "-m", "app", "serve", "--port", str(port), *self.extra_args]
        if self.kind == "openvino":  # in-process, no port: bench/openvino_peer.py
            return [".venv-openvino/bin/python", "-m", "bench.openvino_peer", "--weight-format",
                    *self.extra_args]
        raise ValueError(f"unknown server kind {self.kind!r}")

    def request_model(self, model_dir: Path, served_name: str | None) -> str | None:
        """The `model` to put in requests: transformers serve accepts only its FORCE_MODEL
        string; llama.cpp serves one model whatever the request names (left out)."""
        if self.kind == "transformers":
            return str(model_dir)
        return None if self.kind == "llamacpp" else served_name

    @property
    def cwd(self) -> Path | None:
        """Where the server runs: its checkout; seqgate runs in this one unless given another."""
        return self.checkout or (REPO if self.kind in ("app", "seqgate") else None)

    def for_concurrency(self, concurrency: int) -> ServerSpec:
        """The spec for a run at `concurrency`: llama.cpp gets one slot per concurrent request
        (its slots are its batch; more would only take memory)."""
        if self.kind != "llamacpp":
            return self
        return dataclasses.replace(self, extra_args=("--parallel", str(concurrency),
                                                     *self.extra_args))


SEQGATE = ServerSpec("seqgate", "seqgate")
# Weight-only int4 (engine/model/lowbit.py's blocks): the row that compares with llama.cpp's Q4_1.
SEQGATE_INT4 = ServerSpec("seqgate-int4", "seqgate", ("--quantize", "int4"))
# int8 weights and activations for forwards of many rows (engine/model/w8a8.py), the host's
# default dtype elsewhere: bf16 where the CPU has it (the int8 product then needs VNNI or AMX),
# else fp32.
SEQGATE_W8A8 = ServerSpec("seqgate-w8a8", "seqgate", ("--quantize", "w8a8"))
TF_SERVE = ServerSpec("tf-serve", "transformers")
TF_SERVE_CB = ServerSpec("tf-serve-cb", "transformers", ("--continuous-batching",))
LLAMA_CPP = ServerSpec("llama.cpp", "llamacpp")
# OpenVINO GenAI in-process (bench/openvino_peer.py), the same weights exported by optimum-intel:
# fp16 against seqgate's exact default, int8 and int4 against its quantised rows.
OPENVINO = ServerSpec("openvino", "openvino", ("fp16",))
OPENVINO_INT8 = ServerSpec("openvino-int8", "openvino", ("int8",))
OPENVINO_INT4 = ServerSpec("openvino-int4", "openvino", ("int4",))
SWEEP_SERVERS = {s.label: s for s in (SEQGATE, SEQGATE_INT4, SEQGATE_W8A8, TF_SERVE, TF_SERVE_CB,
                                      LLAMA_CPP, OPENVINO, OPENVINO_INT8, OPENVINO_INT4)}
# Speculative decoding on (seqgate's default) and off, against llama.cpp plain and with its own
# n-gram speculation (bench.serving's `speculative` phase).
SEQGATE_NO_SPEC = ServerSpec("seqgate-nospec", "seqgate", ("--num-speculative-tokens", "0"))
LLAMA_CPP_LOOKUP = ServerSpec("llama.cpp-lookup", "llamacpp", ("--lookup",))
# The served model as its own draft model: what drafting with a second model costs and keeps
# (no smaller model with SmolLM2's tokenizer ships on PyPI).
SEQGATE_SELF_DRAFT = ServerSpec("seqgate-draft-self", "seqgate", ("--speculative-model", "{model}"))
SPECULATIVE_SERVERS = {s.label: s for s in (SEQGATE, SEQGATE_NO_SPEC, SEQGATE_INT4, LLAMA_CPP,
                                            LLAMA_CPP_LOOKUP, SEQGATE_SELF_DRAFT)}


def _venv_script(name: str) -> str:
    """The console script beside this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"`{name}` is not installed beside {sys.executable} nor on PATH")
    return found


def local_model_dir() -> Path:
    """The safetensors copy of the embedded model that seqgate's loader caches (made if missing:
    the first load de-quantises the GGUF, about 15 s)."""
    from engine.model.loader import default_cache_dir, embedded_model_path, gguf_cache_path

    path = gguf_cache_path(embedded_model_path(), default_cache_dir())
    if not (path / "model.safetensors").is_file():
        from engine import EngineConfig, load_model

        load_model(EngineConfig(device="cpu"))
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _status_kib(pid: int, field_name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def tree_rss(pid: int) -> int:
    """Current RSS of a process and its descendants, in bytes."""
    total = 0
    for p in _tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def tree_peak_rss(pid: int) -> int:
    """Peak RSS over each live process's lifetime (VmHWM), summed over the tree, in bytes; where
    the kernel gives no VmHWM (not Linux), the current RSS."""
    total = 0
    for p in _tree(pid):
        hwm = _status_kib(p.pid, "VmHWM")
        if hwm is not None:
            total += hwm * 1024
        else:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
    return total


@dataclass
class RssSampler:
    """Samples a process tree's RSS on a thread while a workload runs; `peak` is the largest."""

    pid: int
    interval: float = 0.2
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        self.peak = tree_rss(self.pid)
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, tree_rss(self.pid))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.peak = max(self.peak, tree_rss(self.pid))


def _tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def _busy_seconds() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0)


@dataclass
class CpuAccount:
    """Where the machine's CPU time went while a workload ran: the server's process tree, this
    process (the load generator), and everything else (`other_cores`: other processes' average
    use, in cores; well above 0 means the numbers were taken on a busy machine). `steal_cores`
    is time the hypervisor gave to other guests."""

    pid: int
    server_cores: float = 0.0
    loadgen_cores: float = 0.0
    other_cores: float = 0.0
    steal_cores: float = 0.0

    def __enter__(self) -> CpuAccount:
        self._start = self._snapshot()
        return self

    def _snapshot(self) -> tuple[float, ...]:
        own = psutil.Process().cpu_times()
        steal = getattr(psutil.cpu_times(), "steal", 0.0)
        return (time.perf_counter(), _busy_seconds(), _tree_cpu_seconds(self.pid),
                own.user + own.system, steal)

    def __exit__(self, *exc) -> None:
        end = self._snapshot()
        wall, busy, server, own, steal = (b - a for a, b in zip(self._start, end))
        if wall > 0:
            self.server_cores, self.loadgen_cores = server / wall, own / wall
            self.other_cores = max(0.0, busy - server - own) / wall
            self.steal_cores = steal / wall

    def to_json(self) -> dict:
        return {"server_cores": self.server_cores, "loadgen_cores": self.loadgen_cores,
                "other_cores": self.other_cores, "steal_cores": self.steal_cores}


class ServerError(RuntimeError):
    """A server did not start, did not answer in time, or died."""


class ServerProcess:
    """One running server (a context manager: started on enter, stopped on exit).

    Its stdout and stderr go to `log_path`; errors quote the log's tail.
    """

    def __init__(self, spec: ServerSpec, model_dir: Path | None, log_path: Path,
                 start_timeout: float = 600.0, stop_timeout: float = 30.0):
        self.spec = spec
        self.model_dir = model_dir
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self.served_name: str | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    @property
    def request_model(self) -> str | None:
        return self.spec.request_model(self.model_dir, self.served_name)

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # the child keeps its own copy of the descriptor
        argv = self.spec.argv(self.model_dir, self.port)
        log.write(("$ " + " ".join(argv) + "\n").encode())
        log.flush()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, cwd=self.spec.cwd)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        if self.spec.kind == "seqgate":
            self.served_name = self._served_name()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        url = self.base_url + self.spec.ready_path
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.label} exited with {self.proc.returncode} while "
                                  f"starting; its log ends:\n{self.log_tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerError(f"{self.spec.label} did not answer 200 on {url} within "
                          f"{self.start_timeout:.0f}s; its log ends:\n{self.log_tail()}")

    def _served_name(self) -> str | None:
        data = httpx.get(self.base_url + "/v1/models", timeout=10.0).json()
        models = data.get("data") or []
        return models[0]["id"] if models else None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after `stop_timeout`; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def peak_rss(self) -> int:
        return tree_peak_rss(self.pid)

    def rss(self) -> int:
        return tree_rss(self.pid)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
