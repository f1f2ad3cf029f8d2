"""OpenVINO GenAI's continuous-batching engine as a benchmark peer, driven in-process.

    .venv-openvino/bin/python -m bench.openvino_peer --model OV_DIR --requests FILE
                                                     --concurrency C --out FILE [--threads 2]

OpenVINO GenAI (`openvino-genai` on PyPI) runs continuous batching with paged attention on the
CPU, but has no HTTP server in Python, so it is measured in its own process: this driver loads
the model, answers two warm-up requests, prints `ready`, waits for `go` on stdin, then keeps
`--concurrency` requests in flight through `ContinuousBatchingPipeline.add_request` / `step`
until every request is done, writes each request's timings (the same fields as the HTTP load
generator's `RequestResult`), prints `done` and exits at the end of its input (so the bench reads
its CPU time and peak memory while it is still there). It pays no HTTP, JSON or detokenisation
cost; the report says so. Requests arrive as token ids (the bench applies the same chat template
for every server), greedy, each with its own token budget, ending at the model's
end-of-sequence token like the other servers' answers.

It runs in `.venv-openvino` (scripts/install_openvino.sh), not in seqgate's environment:
optimum-intel and OpenVINO pin their own transformers. The bench side (`export`, `OpenVINORun`)
is imported by bench.serving and runs in seqgate's environment.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO / ".venv-openvino" / "bin" / "python"
EXPORTS = REPO / "bench" / "results" / "openvino"
# optimum-intel's weight formats the bench exports (fp16: the exact row; int8/int4: the
# quantised rows, against seqgate's and llama.cpp's of the same class).
WEIGHT_FORMATS = ("fp16", "int8", "int4")


# -- bench side (seqgate's environment) ----------------------------------------------------------
def install() -> Path:
    """The OpenVINO environment's interpreter, installed if missing."""
    if not VENV_PYTHON.is_file():
        subprocess.run(["bash", str(REPO / "scripts" / "install_openvino.sh")], check=True)
    return VENV_PYTHON


def export(model_dir: Path, weight_format: str) -> Path:
    """`model_dir` (safetensors) converted to OpenVINO IR with `weight_format`, once per model
    copy (optimum-cli from the local files; nothing from a hub)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r}: one of {', '.join(WEIGHT_FORMATS)}")
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:12]
    out = EXPORTS / f"{model_dir.name}-{key}-{weight_format}"
    if (out / "openvino_model.xml").is_file():
        return out
    cli = install().parent / "optimum-cli"
    # int4 in groups of 32 columns, every layer, as the embedded GGUF's Q4_1 (the default group
    # of 128 does not divide SmolLM2's 576 columns).
    groups = ["--group-size", "32", "--ratio", "1.0"] if weight_format == "int4" else []
    subprocess.run([str(cli), "export", "openvino", "--task", "text-generation-with-past",
                    "--weight-format", weight_format, *groups, "-m", str(model_dir), str(out)],
                   check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return out


class OpenVINORun:
    """One driver process (a context manager): started and warmed on enter; `run()` starts the
    timed requests and returns the driver's results once it has finished."""

    def __init__(self, ov_dir: Path, requests: list[dict], concurrency: int, work: Path,
                 threads: int = 2, start_timeout: float = 600.0):
        work.mkdir(parents=True, exist_ok=True)
        self.requests_path, self.out_path = work / "requests.json", work / "results.json"
        self.log_path = work / "driver.log"
        self.requests_path.write_text(json.dumps(requests))
        self.argv = [str(install()), "-m", "bench.openvino_peer", "--model", str(ov_dir),
                     "--requests", str(self.requests_path), "--concurrency", str(concurrency),
                     "--out", str(self.out_path), "--threads", str(threads)]
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "driver not started"
        return self.proc.pid

    def __enter__(self) -> OpenVINORun:
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, cwd=REPO, text=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise RuntimeError(f"OpenVINO driver did not start ({line!r}); its log ends:\n"
                               + self.log_path.read_text()[-3000:])
        self.start_seconds = time.perf_counter() - t0
        return self

    def run(self) -> dict:
        """The timed requests' results; the driver stays up (its CPU time and memory readable)
        until the run is left."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        if line != "done":
            self.proc.wait()
            raise RuntimeError(f"OpenVINO driver exited with {self.proc.returncode}; its log "
                               "ends:\n" + self.log_path.read_text()[-3000:])
        return json.loads(self.out_path.read_text())

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()  # the driver exits at the end of its input
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# -- driver side (.venv-openvino) ----------------------------------------------------------------
def _pipeline(model: str, threads: int, concurrency: int):
    import openvino_genai as ov_genai

    config = ov_genai.SchedulerConfig()
    config.cache_size = 2  # GB of KV blocks: room for every sequence of the sweep at once
    config.max_num_seqs = max(concurrency, 1)
    config.dynamic_split_fuse = True
    return ov_genai.ContinuousBatchingPipeline(model, config, "CPU",
                                               {"INFERENCE_NUM_THREADS": threads})


def _generation_config(pipe, max_tokens: int):
    config = pipe.get_config()
    config.max_new_tokens = max_tokens
    config.do_sample = False
    return config


def serve(pipe, requests: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """Closed loop over `requests` with `concurrency` in flight; per request: sent, first token
    and end (perf_counter offsets from the start), output tokens and finish reason."""
    import numpy as np
    import openvino as ov
    from openvino_genai.py_openvino_genai import GenerationStatus

    pending = list(enumerate(requests))[::-1]
    active: dict[int, tuple[object, dict]] = {}
    results: list[dict] = [{} for _ in requests]
    t0 = time.perf_counter()
    while pending or active:
        while pending and len(active) < concurrency:
            index, req = pending.pop()
            ids = ov.Tensor(np.array([req["prompt_ids"]], dtype=np.int64))
            handle = pipe.add_request(index, ids, _generation_config(pipe, req["max_tokens"]))
            active[index] = (handle, {"index": index, "sent": time.perf_counter() - t0,
                                      "first_token": None, "end": None, "output_tokens": 0,
                                      "prompt_tokens": len(req["prompt_ids"])})
        pipe.step()
        now = time.perf_counter() - t0
        for index, (handle, rec) in list(active.items()):
            if handle.can_read():
                for output in handle.read().values():
                    rec["output_tokens"] += len(output.generated_ids)
                    if output.generated_ids and rec["first_token"] is None:
                        rec["first_token"] = now
            status = handle.get_status()
            if status != GenerationStatus.RUNNING:
                rec["end"] = now
                rec["finish_reason"] = ("length" if rec["output_tokens"]
                                        >= requests[index]["max_tokens"] else "stop")
                if status != GenerationStatus.FINISHED:
                    rec["error"] = f"generation ended with status {status}"
                results[index] = rec
                del active[index]
    return results, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an OpenVINO IR folder (optimum-cli export)")
    ap.add_argument("--requests", type=Path, required=True,
                    help="JSON list of {prompt_ids, max_tokens}")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    requests = json.loads(args.requests.read_text())
    pipe = _pipeline(args.model, args.threads, args.concurrency)
    warm = [{"prompt_ids": requests[0]["prompt_ids"][:16], "max_tokens": 4}] * 2
    serve(pipe, warm, 1)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    results, wall = serve(pipe, requests, args.concurrency)
    args.out.write_text(json.dumps({"results": results, "wall_seconds": wall}))
    print("done", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
