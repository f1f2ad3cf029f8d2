"""A local Ray instance and `seqgate serve --replicas 2` gateways joined to it (real CLI, real
Ray Serve replicas of a tiny random model saved to disk, real HTTP on a free loopback port)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import ray

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 150


@dataclass
class Gateway:
    """A running `seqgate serve --replicas 2` process."""

    proc: subprocess.Popen
    url: str
    output: list[str]

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=120, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def replicas(self) -> dict[str, dict]:
        return self.health().get("replicas", {})

    def stop(self) -> int:
        """SIGTERM (the drain), then the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("the gateway did not exit within 60 s of SIGTERM:\n" +
                                 "".join(self.output[-40:])) from None


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    # 4 logical CPUs for 2 one-CPU replicas: room for a restarted replica while one stops.
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model.model.save_pretrained(path)
    tiny_model.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def start_gateway(ray_address, tiny_model_dir) -> Iterator[Callable[..., Gateway]]:
    """Start gateways on the module's Ray instance; each is stopped (SIGTERM) at the end, and
    must exit 0."""
    started: list[Gateway] = []

    def start(*flags: str) -> Gateway:
        env = {**os.environ, "RAY_ADDRESS": ray_address, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--replicas", "2", "--port", "0",
             "--model", str(tiny_model_dir), "--max-rolling-batch-size", "8",
             "--drain-timeout", "10", "--served-model-name", "tiny", *flags],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str] = queue.Queue()
        output: list[str] = []

        def read() -> None:
            for line in proc.stdout:
                output.append(line)
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                if proc.poll() is not None:
                    break
                continue
            if m := re.search(r"seqgate is serving \S+ at (http://\S+)", line):
                gateway = Gateway(proc, m.group(1), output)
                started.append(gateway)
                return gateway
        proc.kill()
        raise AssertionError("the gateway did not become ready:\n" + "".join(output[-60:]))

    yield start
    for gateway in started:
        if gateway.proc.poll() is None:
            assert gateway.stop() == 0, "".join(gateway.output[-40:])
