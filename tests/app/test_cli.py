"""The `seqgate` command: the OpenAPI export, start-up errors, and a real serve + SIGTERM drain."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from openapi_spec_validator import validate

from app.__main__ import main
from engine.model.loader import embedded_model_path
from tests.app.test_settings import SEED_PROPERTIES


def test_openapi_command_writes_a_valid_document(tmp_path, capsys):
    path = tmp_path / "doc" / "openapi.json"
    assert main(["openapi", str(path)]) == 0
    doc = json.loads(path.read_text())
    validate(doc)
    assert "/v1/chat/completions" in doc["paths"] and str(path) in capsys.readouterr().out


def test_bad_config_stops_startup_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "serving.properties"
    bad.write_text("option.max_sparsity=lots\n")
    assert main(["serve", "--config", str(bad)]) == 2
    assert "option.max_sparsity" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.properties")]) == 2


@pytest.mark.slow
def test_serve_seed_properties_then_drain_on_sigterm(tmp_path):
    """The seed's serving.properties (model id replaced) starts unchanged; SIGTERM refuses new
    work with 503 while the running stream finishes, then the process exits cleanly."""
    props = tmp_path / "serving.properties"
    props.write_text(SEED_PROPERTIES.replace("/models/SmolLM2-135M-Instruct.gguf",
                                             str(embedded_model_path())))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--config", str(props),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    try:
        banner = ""
        while "seqgate is serving" not in banner:
            banner = lines.get(timeout=180)
        url = banner.split(" at ")[1].split()[0]
        assert lines.get(timeout=5).startswith("try:  curl")

        body = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
        first, events = threading.Event(), []

        def stream():
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "service_unavailable"
        reader.join(timeout=120)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(stderr)
    assert "option.dtype=fp16 but no GPU" in log or "cuda" in log.lower()
    assert "draining" in log


def test_a_model_that_cannot_load_exits_1(tmp_path, capsys):
    """The port opens first; the failed load then ends the process with status 1 and says why."""
    missing = tmp_path / "nowhere.gguf"
    assert main(["serve", "--model", str(missing), "--port", "0", "--log-level", "error"]) == 1
    captured = capsys.readouterr()
    assert "listening at http://127.0.0.1:" in captured.out
    assert str(missing) in captured.err


def _running_sequences(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("seqgate_running_sequences "))


def start_cli(*args: str) -> tuple[subprocess.Popen, queue.Queue[str], list[str]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    return proc, lines, stderr


@pytest.mark.slow
def test_drain_timeout_ends_open_streams_with_service_unavailable():
    """A stream still running when --drain-timeout ends gets a service_unavailable error event and
    [DONE] (not a 500), a non-streamed request a 503; the process still exits 0."""
    proc, lines, stderr = start_cli("--drain-timeout", "1", "--max-rolling-batch-size", "4")
    try:
        banner = ""
        while "seqgate is serving" not in banner:
            banner = lines.get(timeout=180)
        url = banner.split(" at ")[1].split()[0]
        body = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
        started = threading.Barrier(3)
        results: dict[str, object] = {}

        def stream():
            events = []
            with httpx.stream("POST", url + "/v1/chat/completions",
                              json={**body, "stream": True}, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:
                            started.wait(30)
            results["stream"] = events

        def plain():
            started.wait(30)
            results["plain"] = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        started.wait(60)
        deadline = time.monotonic() + 60  # until the non-streamed request is in the batch too
        while _running_sequences(url) < 2:
            assert time.monotonic() < deadline, "the second request never joined the batch"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        events = results["stream"]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
        plain_response = results["plain"]
        assert plain_response.status_code == 503, plain_response.text
        assert plain_response.json()["error"]["code"] == "service_unavailable"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "generation_failed" not in "".join(stderr)


_SHAPES_SCRIPT = """
import sys, torch
if sys.argv[1] == "bound":
    from app.__main__ import bound_native_memory
    bound_native_memory()
torch.set_num_threads(1)
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024
weights = [torch.randn(o, i, dtype=torch.bfloat16) for o, i in [(1536, 576), (576, 1536),
                                                                 (8192, 576)]]
if sys.argv[2] == "prepacked":  # engine.model.prepack's path: weights laid out once for oneDNN
    from engine.model.prepack import pack, product
    packed = [pack(w) for w in weights]
    def linear(x, i):
        return product(x, packed[i], None)
else:
    def linear(x, i):
        return torch.nn.functional.linear(x, weights[i])
def run(rows):
    for m in rows:
        for i, w in enumerate(weights):
            linear(torch.randn(m, w.shape[1], dtype=torch.bfloat16), i)
run(range(1, 41))
before = rss()
run(range(41, 241))
print(rss() - before)
"""


@pytest.mark.parametrize("path", ["plain", "prepacked"])
def test_serve_bounds_the_matmul_kernel_caches(path):
    """`seqgate serve` caps the per-shape kernel caches of torch's CPU matmuls (oneDNN's and
    ideep's): 600 new matmul shapes, as a rolling batch makes, leave resident memory where it
    was, through `F.linear` and through prepacked weights alike. Measured here with the caches
    left at their defaults: about 390 and 355 MiB more."""
    import torch

    from engine.model import prepack

    # Without oneDNN's bf16 products torch multiplies bf16 by its own loops, which cache nothing.
    if not prepack.supported(torch.empty(0, dtype=torch.bfloat16)):
        pytest.skip("this CPU's oneDNN has no bf16 matrix products")
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", _SHAPES_SCRIPT, "bound", path], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    assert int(out.stdout.strip()) < 64, out.stdout
