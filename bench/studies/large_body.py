"""Does a large request stall the streams already running? (issue: event loop hardening)

Starts seqgate on a free loopback port, opens `--streams` greedy chat streams, and once every one
of them is decoding, sends `--bodies` requests of about `--body-mib` MiB each (one huge user
message, so the server must render the chat template and tokenize it before it can answer
context_length_exceeded; one of them a /v1/completions prompt). Each stream's inter-token gaps
(time between SSE content events) are recorded; the figure of merit is each stream's largest gap
while the large requests are sent and answered (plus one second), over its median gap. Target: at
most 3. The same ratio over the 3 s just before (no large request) is the control: the noise of a
run without them.

`--checkout DIR` runs the server from another checkout (`python -m app serve` with DIR as the
working directory, the same interpreter), to measure an older commit side by side:
    git worktree add /tmp/before <commit>
    python -m bench.studies.large_body --checkout /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from bench import provenance
from bench.harness import RESULTS_DIR, StreamTrace, server_log, trace, until_streaming
from bench.servers import ServerProcess, ServerSpec

PROMPT = "Write a long story about a lighthouse keeper and the sea."
CONTROL_SECONDS = 3.0


def _content_event(payload: str) -> bool:
    return (payload.startswith("{") and '"content":"' in payload
            and '"content":""' not in payload)


async def run_stream(client: httpx.AsyncClient, into: StreamTrace, max_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    await trace(client, "/v1/chat/completions", body, into, _content_event)


def large_bodies(count: int, mib: float, kind: str = "mixed") -> list[tuple[str, dict | bytes]]:
    text = "the quick brown fox jumps over the lazy dog " * int(mib * 1024 * 1024 / 44)
    out: list[tuple[str, dict | bytes]] = []
    for i in range(count):
        if kind == "invalid-json":  # read, then refused at the first byte: no tokenizing
            out.append(("/v1/chat/completions", b"x" * int(mib * 1024 * 1024)))
        elif i % 2:
            out.append(("/v1/completions", {"prompt": text, "max_tokens": 1}))
        else:
            out.append(("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": text}], "max_tokens": 1}))
    return out


def send_large(url: str, payload: bytes) -> dict:
    t0 = time.perf_counter()
    r = httpx.post(url, content=payload, headers={"content-type": "application/json"},
                   timeout=600)
    return {"path": httpx.URL(url).path, "bytes": len(payload), "status": r.status_code,
            "code": (r.json().get("error") or {}).get("code"),
            "seconds": round(time.perf_counter() - t0, 3)}


async def measure(url: str, streams: int, max_tokens: int, bodies: int, mib: float,
                  kind: str = "mixed") -> dict:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        traces = [StreamTrace() for _ in range(streams)]
        tasks = [asyncio.create_task(run_stream(client, t, max_tokens)) for t in traces]
        await until_streaming(traces, tasks, 10, check=False)
        payloads = [(path, body if isinstance(body, bytes) else json.dumps(body).encode())
                    for path, body in large_bodies(bodies, mib, kind)]
        # Steady state first: the same length of time without a large body, as the control.
        answers = []
        control_start = time.perf_counter()
        await asyncio.sleep(CONTROL_SECONDS)
        window_start = time.perf_counter()
        for path, payload in payloads:
            # From another thread, so this loop keeps reading the streams: the sender's own
            # work (writing 4 MiB through httpx) must not show up as a gap in the measurement.
            answers.append(await asyncio.to_thread(send_large, url + path, payload))
        # One more second of tokens, so a stall right at the end of the last answer shows.
        await asyncio.sleep(1.0)
        window_end = time.perf_counter()
        await asyncio.gather(*tasks)
    rows = []
    for t in traces:
        median = statistics.median(t.gaps(control_start, window_end))
        during = t.gaps(window_start, window_end)
        control = t.gaps(control_start, window_start)
        rows.append({"tokens": len(t.times), "median_gap_s": round(median, 4),
                     "max_gap_during_s": round(max(during), 4),
                     "max_over_median": round(max(during) / median, 2),
                     "control_max_over_median": round(max(control) / median, 2)})
    worst = max(r["max_over_median"] for r in rows)
    return {"large_requests": answers, "window_s": round(window_end - window_start, 2),
            "streams": rows, "worst_max_over_median": worst,
            "worst_control_max_over_median": max(r["control_max_over_median"] for r in rows),
            "target": 3.0, "passed": worst <= 3.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--bodies", type=int, default=2)
    parser.add_argument("--body-mib", type=float, default=3.9)
    parser.add_argument("--kind", choices=("mixed", "invalid-json"), default="mixed",
                        help="mixed: chat and completions prompts to tokenize; invalid-json: a "
                        "body refused before any tokenizing (isolates reading the body)")
    parser.add_argument("--checkout", type=Path, default=None)
    parser.add_argument("--server-arg", action="append", default=[])
    args = parser.parse_args()
    spec = ServerSpec("seqgate", "app", tuple(args.server_arg), checkout=args.checkout)
    log = server_log(RESULTS_DIR / "large_body.json", "server")
    with ServerProcess(spec, None, log, stop_timeout=60) as server:
        result = asyncio.run(measure(server.base_url, args.streams, args.max_tokens,
                                     args.bodies, args.body_mib, args.kind))
    result["machine"] = provenance.machine()
    result["command"] = provenance.command(module="bench.studies.large_body")
    result["checkout"] = "other" if args.checkout else "this"
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
