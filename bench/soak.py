"""Soak and fault run: does seqgate stay correct, bounded and drainable under long mixed load?

    python -m bench.soak [--duration 300] [--concurrency 128] [--seed 0] [--drain-timeout 10]
                         [--fuzz-examples N | --skip-fuzz] [--out bench/results/soak.json]
                         [--report docs/reliability.md]
    make soak [SOAK_ARGS="..."]

What it measures, and why:
  1. Starts `seqgate serve` (the embedded SmolLM2, on the CPU, a free 127.0.0.1 port) and reads
     the server's RSS at start, after a warm-up and at the end, and every 5 s between: memory
     that keeps growing under steady load is a leak (target: < 5% from the median of the first
     15% of the loaded time after the warm-up to the median of the last 15%; single samples
     move by ±100 MiB with the KV of whatever runs at that instant). The warm-up is 10% of the
     run, at most 30 s, and then as long as the prefix cache takes to fill (its first eviction,
     from /metrics; at most half the run): until then the cache grows by design, up to its
     budget (--prompt-cache-bytes, 512 MiB by default).
  2. Drives it with `--concurrency` closed-loop clients over the mix of bench/soak_traffic.py:
     ShareGPT chats and completions, streamed or not, greedy or sampled, n=2, stop strings;
     10% cut by the client mid-way (the engine must free their slots), 5% bad input (each must
     get a 4xx in OpenAI's error envelope). Any 5xx, any request with no answer, any stream that
     ends without [DONE] or an error event is a finding.
  3. `--drain-lead` seconds before the end, sends SIGTERM with requests in flight, stops starting
     new ones except a few probes (which must get 503 service_unavailable), and records how every
     in-flight request ended (completed, or 503 / an SSE error event then [DONE]); the server
     must exit 0 within --drain-timeout + --exit-margin.
  4. Reads the /v1/responses store's bytes and entries from /metrics with every RSS reading: the
     soak runs the server with a small store (--response-store-bytes, 128 KiB) so that it fills
     and evicts under load; its bytes must never exceed that bound.
  5. Scrapes /metrics before SIGTERM: `seqgate_abort_free_steps` (engine steps from an abort to
     the slot being free; target: all within 3) and `seqgate_request_outcomes_total`; "n/a" when
     the server does not expose them.
  6. Unless --skip-fuzz, runs schemathesis through tests/openapi/test_fuzz.py with
     FUZZ_MAX_EXAMPLES=--fuzz-examples and the coverage phase (at least 5,000 cases by default).
Raw results go to --out (JSON, with every request's outcome), the report to --report
(bench/soak_report.py renders it; `python -m bench.soak_report` re-renders from the JSON).
Exits 1 when a target fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from bench import provenance
from bench.harness import RESULTS_DIR, write_json
from bench.scrape import Samples, histogram_delta, scrape
from bench.servers import SEQGATE, CpuAccount, RssSampler, ServerProcess, local_model_dir
from bench.sharegpt import load_requests
from bench.soak_report import (
    ABORT_FREE_STEPS,
    drain_summary,
    targets,
    traffic_summary,
    write_report,
)
from bench.soak_traffic import (
    CHAT_PATH,
    MixShares,
    Outcome,
    RequestMix,
    ServedModel,
    SoakRequest,
    client_loop,
    send,
)

REPO = Path(__file__).resolve().parent.parent
# Measured here (coverage phase on): 988 cases at FUZZ_MAX_EXAMPLES=5 and 1,068 at 15, so about
# 948 fixed (examples and coverage phases) + 8 per example (the 8 operations that take input grow
# by one case each); 550 gives about 5,350, a margin over the 5,000 target. The generation run's
# cases each run the model, so this takes a while on a CPU.
DEFAULT_FUZZ_EXAMPLES = 550
PROBE_DELAYS = (0.3, 0.6, 0.9)
RSS_SERIES_SECONDS = 5.0  # seconds after SIGTERM: late enough for the handler to have run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of traffic, drain in")
    ap.add_argument("--concurrency", type=int, default=128, help="closed-loop clients")
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle and request mix seed")
    ap.add_argument("--drain-timeout", type=float, default=10.0, help="passed to seqgate serve")
    ap.add_argument("--drain-lead", type=float, default=15.0,
                    help="send SIGTERM this many seconds before the end of --duration")
    ap.add_argument("--exit-margin", type=float, default=15.0,
                    help="the server must exit within --drain-timeout plus this")
    ap.add_argument("--bad-share", type=float, default=MixShares.bad,
                    help="fraction of requests that are bad input")
    ap.add_argument("--cut-share", type=float, default=MixShares.cut,
                    help="fraction of requests the client cuts mid-way")
    ap.add_argument("--max-tokens", type=int, default=32,
                    help="cap on each request's max_tokens (small, so requests cycle)")
    ap.add_argument("--max-prompt", type=int, default=512, help="longest ShareGPT prompt, tokens")
    ap.add_argument("--exchanges", type=int, default=400, help="ShareGPT exchanges to draw from")
    ap.add_argument("--request-timeout", type=float, default=180.0,
                    help="a request with no answer after this long counts as unanswered")
    ap.add_argument("--response-store-bytes", type=int, default=128 * 1024,
                    help="passed to seqgate serve: small, so the store fills within the soak")
    ap.add_argument("--fuzz-examples", type=int, default=DEFAULT_FUZZ_EXAMPLES,
                    help="FUZZ_MAX_EXAMPLES for the schemathesis run")
    ap.add_argument("--skip-fuzz", action="store_true")
    ap.add_argument("--seqgate-arg", action="append", default=[],
                    help="extra flag for seqgate serve (repeatable, e.g. "
                         "--seqgate-arg=--num-threads=1)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json", help="raw results JSON")
    ap.add_argument("--report", type=Path, default=REPO / "docs" / "reliability.md")
    args = ap.parse_args(argv)
    if warmup_seconds(args.duration) >= args.duration - args.drain_lead:
        ap.error(f"--duration {args.duration:g} leaves no load between the warm-up "
                 f"({warmup_seconds(args.duration):g} s) and SIGTERM (--drain-lead "
                 f"{args.drain_lead:g} s before the end)")
    return args


def warmup_seconds(duration: float) -> float:
    """The fixed part of the warm-up; `until_prefix_cache_full` may extend it."""
    return min(0.1 * duration, 30.0)


def prefix_cache_fill(samples: Samples) -> dict | None:
    """The prefix cache's budget, bytes and evictions from /metrics; None when not exposed."""
    budget = samples.get("seqgate_prompt_cache_budget_bytes")
    if budget is None:
        return None
    return {"budget": budget, "bytes": samples.get("seqgate_prompt_cache_bytes", 0.0),
            "evictions": samples.get("seqgate_prompt_cache_evictions_total", 0.0)}


async def until_prefix_cache_full(server: ServerProcess, longest: float) -> tuple[bool, dict]:
    """Keep the load on until the prefix cache has evicted once (its budget is full: from then
    on it holds about the same bytes), at most `longest` seconds. (alive, what was seen);
    returns at once when the cache is off or the server does not expose it."""
    t0 = time.perf_counter()
    seen: dict = {"full": False}
    while True:
        try:
            fill = prefix_cache_fill(await asyncio.to_thread(scrape, server.base_url))
        except httpx.HTTPError:
            fill = None
        seen.update(fill or {}, seconds=time.perf_counter() - t0)
        seen["full"] = bool(fill and fill["budget"] and fill["evictions"])
        if not (fill and fill["budget"]) or seen["full"] or seen["seconds"] >= longest:
            return server.proc.poll() is None, seen
        if not await under_load(server, 1.0):
            return False, seen


# -- /metrics ---------------------------------------------------------------------------------

def abort_free(samples: Samples, within: float = ABORT_FREE_STEPS) -> dict | None:
    """Aborts whose slot was free within `within` engine steps, from the
    `seqgate_abort_free_steps` histogram; None when the server does not expose it."""
    count = samples.get("seqgate_abort_free_steps_count")
    prefix = "seqgate_abort_free_steps_bucket{le="
    bounds = {float(k[len(prefix):-1]): v for k, v in samples.items() if k.startswith(prefix)}
    if count is None or not bounds:
        return None
    fitting = [le for le in bounds if le <= within]
    freed = bounds[max(fitting)] if fitting else 0.0
    return {"within": freed, "count": count, "fraction": freed / count if count else None,
            "le": max(fitting) if fitting else None}


def request_outcomes(samples: Samples) -> dict[str, dict[str, float]] | None:
    """`seqgate_request_outcomes_total` as {route: {outcome: count}}; None when absent."""
    prefix = "seqgate_request_outcomes_total{"
    out: dict[str, dict[str, float]] = {}
    for key, value in samples.items():
        if key.startswith(prefix):
            labels = dict(pair.split("=", 1) for pair in key[len(prefix):-1].split(",") if pair)
            out.setdefault(labels.get("route", "?"), {})[labels.get("outcome", "?")] = value
    return out or None


def engine_metrics(base_url: str) -> dict:
    try:
        samples = scrape(base_url)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "abort_free": None,
                "request_outcomes": None}
    return {"abort_free": abort_free(samples), "request_outcomes": request_outcomes(samples),
            # how much work the engine did: a stall with steps running is not one without
            "engine_steps": samples.get("seqgate_engine_steps_total"),
            "generated_tokens": samples.get("seqgate_generated_tokens_total"),
            "prompt_tokens": samples.get("seqgate_prompt_tokens_total"),
            # what the engine itself holds, to set against the RSS growth
            "prompt_cache_bytes": samples.get("seqgate_prompt_cache_bytes"),
            "kv_cache_bytes": samples.get("seqgate_kv_cache_bytes"),
            "kv_cache_peak_bytes": samples.get("seqgate_kv_cache_peak_bytes"),
            "step_seconds": histogram_delta({}, samples, "seqgate_step_seconds")
            if "seqgate_step_seconds_count" in samples else None}


# -- schemathesis -----------------------------------------------------------------------------

def fuzz_command() -> list[str]:
    return [sys.executable, "-m", "pytest", "tests/openapi/test_fuzz.py", "-p", "no:cacheprovider",
            "-q"]


def parse_fuzz_output(text: str) -> dict:
    """Cases, responses by status per run, and pytest's pass/fail counts from the output of
    tests/openapi/test_fuzz.py (its conftest prints the schemathesis summary)."""
    cases = re.search(r"schemathesis: (\d+) cases", text)
    statuses: dict[str, dict[str, int]] = {}
    for run, tally in re.findall(r"^\s*(\S+) responses by status: (.*)$", text, re.M):
        statuses[run] = {code: int(n) for code, n in re.findall(r"(\d+): (\d+)", tally)}
    summary = [line for line in text.splitlines()
               if re.search(r"\d+ (passed|failed|errors?)\b", line)]
    counts = dict((kind, int(n)) for n, kind in
                  re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary[-1] if summary
                             else ""))
    return {"cases": int(cases.group(1)) if cases else 0, "statuses": statuses,
            "passed": counts.get("passed", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)}


def run_fuzz(examples: int, log: Path) -> dict:
    env = {**os.environ, "FUZZ_MAX_EXAMPLES": str(examples), "FUZZ_COVERAGE": "1"}
    print(f"[fuzz] schemathesis with FUZZ_MAX_EXAMPLES={examples} (log: {log})", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(fuzz_command(), cwd=REPO, env=env, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    return {**parse_fuzz_output(proc.stdout), "rc": proc.returncode,
            "seconds": time.perf_counter() - t0,
            "command": f"FUZZ_MAX_EXAMPLES={examples} FUZZ_COVERAGE=1 python -m pytest "
                       "tests/openapi/test_fuzz.py -p no:cacheprovider -q"}


# -- the run ----------------------------------------------------------------------------------

@dataclasses.dataclass
class SoakRun:
    """What one traffic run observed, before summarizing."""

    outcomes: list[Outcome]
    rss: dict
    metrics: dict
    sigterm_at: float
    exit_code: int | None
    exit_seconds: float | None
    killed: bool
    cpu: dict  # CpuAccount: server, load generator and other processes, in cores
    died_at: float | None = None  # seconds into the run the server exited on its own


def window_growth(series: list[tuple[float, int]], warm_at: float, end_at: float) -> dict:
    """RSS growth between the median of the samples just after the warm-up and of the last ones
    before SIGTERM, each window 15% of the loaded time (at least 15 s). One sample at each end
    moves with the KV of whatever runs at that instant (±100 MiB here); a median does not."""
    window = max(15.0, 0.15 * (end_at - warm_at))
    first = [r for t, r in series if warm_at <= t <= warm_at + window]
    last = [r for t, r in series if end_at - window <= t <= end_at]
    if not first or not last or warm_at + window > end_at - window:
        return {}
    a, b = statistics.median(first), statistics.median(last)
    return {"window_seconds": window, "warm_median": a, "end_median": b,
            "median_growth": (b - a) / a}


async def under_load(server: ServerProcess, seconds: float) -> bool:
    """Let the clients run for `seconds`; False as soon as the server process has exited (a
    crash: the clients would otherwise spin on refused connections until the end)."""
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        if server.proc.poll() is not None:
            return False
        await asyncio.sleep(min(0.5, left))
    return server.proc.poll() is None


def wait_for_exit(proc: subprocess.Popen, deadline: float) -> tuple[int | None, float, bool]:
    """(exit code, seconds waited, whether it had to be killed)."""
    t0 = time.perf_counter()
    try:
        return proc.wait(deadline), time.perf_counter() - t0, False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return proc.returncode, time.perf_counter() - t0, True


async def probe_drain(client: httpx.AsyncClient, model: str | None, t0: float,
                      proc: subprocess.Popen) -> list[Outcome]:
    """A few short chats during the drain: each must be refused with 503 service_unavailable.
    None is sent once the server has exited (a drain with little in flight is over quickly)."""
    body = json.dumps({"model": model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Still there?"}]}).encode()
    probes, start = [], time.perf_counter()
    for delay in PROBE_DELAYS:
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
        if proc.poll() is not None:
            break
        probes.append(await send(client, SoakRequest("probe", CHAT_PATH, body, False), t0,
                                 probe=True))
    return probes


def kv_bytes(base_url: str) -> float | None:
    """The KV bytes the engine holds now: the rolling batch's (seqgate_kv_cache_bytes) and the
    prefix cache's (seqgate_prompt_cache_bytes, bounded by --prompt-cache-bytes and filling up
    under load by design); None if not exposed."""
    try:
        scraped = scrape(base_url)
    except httpx.HTTPError:
        return None
    batch = scraped.get("seqgate_kv_cache_bytes")
    return None if batch is None else batch + scraped.get("seqgate_prompt_cache_bytes", 0.0)


def response_store(base_url: str) -> tuple[float, float] | None:
    """(entries, bytes) of the /v1/responses store now; None if not exposed."""
    try:
        scraped = scrape(base_url)
    except httpx.HTTPError:
        return None
    nbytes = scraped.get("seqgate_response_store_bytes")
    return None if nbytes is None else (scraped.get("seqgate_response_store_entries", 0.0), nbytes)


async def sample_rss(server: ServerProcess, stop: asyncio.Event, t0: float,
                     series: list[tuple[float, int]], store: list[tuple[float, float, float]],
                     every: float = RSS_SERIES_SECONDS) -> None:
    """(seconds, RSS) every `every` seconds until `stop`: whether growth levels off; and the
    response store's (seconds, entries, bytes): whether it stays within its bound."""
    while not stop.is_set():
        at = round(time.perf_counter() - t0, 1)
        series.append((at, await asyncio.to_thread(server.rss)))
        if (held := await asyncio.to_thread(response_store, server.base_url)) is not None:
            store.append((at, *held))
        await asyncio.sleep(every)


async def drive(server: ServerProcess, mix: RequestMix, args: argparse.Namespace) -> SoakRun:
    """Load, RSS readings, the /metrics scrape, SIGTERM with requests in flight, the drain."""
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    rss = {"start": server.rss(), "warmup_seconds": warmup_seconds(args.duration)}
    limits = httpx.Limits(max_connections=args.concurrency + len(PROBE_DELAYS),
                          max_keepalive_connections=args.concurrency + len(PROBE_DELAYS))
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=server.base_url, limits=limits,
                                 timeout=timeout) as client:
        t0 = time.perf_counter()
        clients = [asyncio.create_task(client_loop(client, mix, stop, outcomes, t0))
                   for _ in range(args.concurrency)]
        series = asyncio.create_task(sample_rss(server, stop, t0, rss.setdefault("series", []),
                                                rss.setdefault("response_store", [])))
        with CpuAccount(server.pid) as cpu, RssSampler(server.pid, interval=1.0) as sampler:
            alive = await under_load(server, rss["warmup_seconds"])
            if alive:
                load = args.duration - args.drain_lead
                alive, rss["prefix_cache"] = await until_prefix_cache_full(
                    server, load / 2 - rss["warmup_seconds"])
                rss["warmup_seconds"] = round(time.perf_counter() - t0, 1)
            if alive:
                rss["warm"] = await asyncio.to_thread(server.rss)
                rss["kv_warm"] = await asyncio.to_thread(kv_bytes, server.base_url)
                rss["warmup_answers"] = sum(o.status is not None for o in outcomes)
                print(f"  warm-up over: {len(outcomes)} requests done, "
                      f"RSS {rss['warm'] / 2**20:.0f} MiB", flush=True)
                alive = await under_load(server, t0 + args.duration - args.drain_lead
                                         - time.perf_counter())
        if not alive:
            stop.set()
            died_at = time.perf_counter() - t0
            print(f"  the server exited by itself (code {server.proc.returncode}) at "
                  f"{died_at:.1f} s, after {len(outcomes)} requests", flush=True)
            _, pending = await asyncio.wait(clients, timeout=30.0)
            for task in pending:
                task.cancel()
            return SoakRun(outcomes, rss, {}, died_at, server.proc.returncode, 0.0, False,
                           cpu.to_json(), died_at=died_at)
        rss["end"], rss["peak"] = await asyncio.to_thread(server.rss), sampler.peak
        rss["kv_end"] = await asyncio.to_thread(kv_bytes, server.base_url)
        metrics = await asyncio.to_thread(engine_metrics, server.base_url)
        stop.set()
        sigterm_at = time.perf_counter() - t0
        server.proc.send_signal(signal.SIGTERM)
        print(f"  SIGTERM at {sigterm_at:.1f} s after {len(outcomes)} requests", flush=True)
        probes = asyncio.create_task(probe_drain(client, server.served_name, t0, server.proc))
        code, waited, killed = await asyncio.to_thread(
            wait_for_exit, server.proc, args.drain_timeout + args.exit_margin)
        # The server is gone: every client's last request has ended one way or another.
        series.cancel()
        _, pending = await asyncio.wait([*clients, probes], timeout=30.0)
        for task in pending:
            task.cancel()
            if task is not probes:
                now = time.perf_counter() - t0
                outcomes.append(Outcome("unfinished", False, False, sigterm_at, now,
                                        problem="client still waiting 30 s after the server "
                                                "exited"))
        outcomes += probes.result() if probes.done() else []
    rss["growth"] = (rss["end"] - rss["warm"]) / rss["warm"] if rss.get("warm") else None
    rss.update(window_growth(rss.get("series", []), rss["warmup_seconds"], sigterm_at))
    if rss.get("warm") and rss.get("kv_warm") is not None and rss.get("kv_end") is not None:
        # What is not the live batch's KV (which follows the requests running at that moment).
        base = rss["warm"] - rss["kv_warm"]
        rss["growth_net_of_kv"] = (rss["end"] - rss["kv_end"] - base) / base
    return SoakRun(outcomes, rss, metrics, sigterm_at, code, waited, killed, cpu.to_json())


def log_errors(text: str) -> list[str]:
    """The server log's ERROR lines, each traceback reduced to its exception line."""
    out, in_traceback = [], False
    for line in text.splitlines():
        if line.startswith("Traceback"):
            in_traceback = True
        elif in_traceback and line and not line.startswith(" "):
            out.append("  " + line[:300])
            in_traceback = False
        elif re.search(r"\b(ERROR|CRITICAL)\b", line):
            out.append(line[:300])
    return out


def server_log_errors(log: Path) -> list[str]:
    try:
        return log_errors(log.read_text(errors="replace"))
    except OSError:
        return []


def soak(args: argparse.Namespace, argv: list[str] | None) -> dict:
    model_dir = local_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    exchanges = load_requests(tokenizer, args.exchanges, seed=args.seed,
                              max_prompt=args.max_prompt, max_output=args.max_tokens)
    spec = dataclasses.replace(SEQGATE, label="seqgate soak", extra_args=(
        "--drain-timeout", f"{args.drain_timeout:g}",
        "--response-store-bytes", str(args.response_store_bytes), *args.seqgate_arg))
    log = args.out.with_suffix(".server.log")
    data: dict = {"meta": provenance.meta(argv, "bench.soak", args, started=True,
                                          finished=False)}
    with ServerProcess(spec, model_dir, log) as server:
        version = httpx.get(server.base_url + "/version", timeout=10.0).json()
        served = ServedModel(server.served_name, int(version.get("max_model_len") or 8192))
        print(f"[soak] seqgate on {server.base_url} ({server.start_seconds:.1f} s to start), "
              f"{args.concurrency} clients for {args.duration:g} s", flush=True)
        mix = RequestMix(exchanges, served, args.seed,
                         MixShares(bad=args.bad_share, cut=args.cut_share))
        run = asyncio.run(drive(server, mix, args))
    data["server"] = {"start_seconds": server.start_seconds, "exit_code": run.exit_code,
                      "died_at": run.died_at,
                      "exit_seconds": run.exit_seconds, "killed": run.killed,
                      "exit_deadline": args.drain_timeout + args.exit_margin,
                      "max_model_len": served.max_model_len, "log": str(log),
                      "response_store_bytes": args.response_store_bytes,
                      "log_errors": server_log_errors(log)}
    data["rss"] = run.rss
    data["cpu"] = run.cpu
    data["metrics"] = run.metrics
    data["traffic"] = traffic_summary(run.outcomes, run.sigterm_at)
    data["drain"] = drain_summary(run.outcomes, run.sigterm_at)
    data["outcomes"] = [o.to_json() for o in run.outcomes]
    return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = soak(args, argv)
    write_json(args.out, data)
    data["fuzz"] = None if args.skip_fuzz else run_fuzz(args.fuzz_examples,
                                                        args.out.with_suffix(".fuzz.log"))
    data["meta"]["finished"] = provenance.now()
    write_json(args.out, data)
    print(f"wrote {args.out} and {write_report(data, args.report)}")
    failed = False
    for t in targets(data):
        verdict = "n/a" if t.passed is None else ("pass" if t.passed else "FAIL")
        print(f"  {verdict:>4}  {t.figure}: {t.value} (target {t.target})")
        failed |= t.passed is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
