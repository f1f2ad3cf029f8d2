"""Does a large request stall the streams already running? (issue: event loop hardening)

Starts seqgate on a free loopback port, opens `--streams` greedy chat streams, and once every one
of them is decoding, sends `--bodies` requests of about `--body-mib` MiB each (one huge user
message, so the server must render the chat template and tokenize it before it can answer
context_length_exceeded; one of them a /v1/completions prompt). Each stream's inter-token gaps
(time between SSE content events) are recorded; the figure of merit is each stream's largest gap
over its median gap, during the whole run. Target: at most 3.

`--checkout DIR` runs the server from another checkout (`python -m app serve` with DIR as the
working directory, the same interpreter), to measure an older commit side by side:
    git worktree add /tmp/before <commit>
    python -m bench.large_body --checkout /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import provenance
from bench.servers import free_port

PROMPT = "Write a long story about a lighthouse keeper and the sea."


@dataclass
class StreamTrace:
    """Arrival times of one stream's content events."""

    times: list[float] = field(default_factory=list)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


async def run_stream(client: httpx.AsyncClient, trace: StreamTrace, max_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                trace.times.append(time.perf_counter())


def large_bodies(count: int, mib: float) -> list[tuple[str, dict]]:
    text = "the quick brown fox jumps over the lazy dog " * int(mib * 1024 * 1024 / 44)
    out = []
    for i in range(count):
        if i % 2:
            out.append(("/v1/completions", {"prompt": text, "max_tokens": 1}))
        else:
            out.append(("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": text}], "max_tokens": 1}))
    return out


async def measure(url: str, streams: int, max_tokens: int, bodies: int, mib: float) -> dict:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        traces = [StreamTrace() for _ in range(streams)]
        tasks = [asyncio.create_task(run_stream(client, t, max_tokens)) for t in traces]
        while min(len(t.times) for t in traces) < 10:
            await asyncio.sleep(0.05)
        answers = []
        for path, body in large_bodies(bodies, mib):
            payload = json.dumps(body).encode()
            t0 = time.perf_counter()
            r = await client.post(path, content=payload,
                                  headers={"content-type": "application/json"})
            answers.append({"path": path, "bytes": len(payload), "status": r.status_code,
                            "code": (r.json().get("error") or {}).get("code"),
                            "seconds": round(time.perf_counter() - t0, 3)})
        await asyncio.gather(*tasks)
    rows = []
    for t in traces:
        gaps = t.gaps()
        median = statistics.median(gaps)
        rows.append({"tokens": len(t.times), "median_gap_s": round(median, 4),
                     "max_gap_s": round(max(gaps), 4), "max_over_median": round(max(gaps) / median,
                                                                                2)})
    worst = max(r["max_over_median"] for r in rows)
    return {"large_requests": answers, "streams": rows, "worst_max_over_median": worst,
            "target": 3.0, "passed": worst <= 3.0}


def start_server(checkout: Path | None, port: int, extra: list[str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "app", "serve", "--port", str(port), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, cwd=checkout or Path(__file__).resolve().parents[1], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--bodies", type=int, default=2)
    parser.add_argument("--body-mib", type=float, default=3.9)
    parser.add_argument("--checkout", type=Path, default=None)
    parser.add_argument("--server-arg", action="append", default=[])
    args = parser.parse_args()
    port = free_port()
    proc = start_server(args.checkout, port, args.server_arg)
    try:
        result = asyncio.run(measure(f"http://127.0.0.1:{port}", args.streams, args.max_tokens,
                                     args.bodies, args.body_mib))
    finally:
        proc.terminate()
        proc.wait(60)
    result["machine"] = provenance.machine()
    result["command"] = provenance.command()
    result["checkout"] = "other" if args.checkout else "this"
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
