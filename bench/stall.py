"""Do long prompts stall the streams already running? (issue 10: stall-free batching)

    python -m bench.stall [--streams 16] [--long 8] [--budgets 128,256]
                          [--stall-ratios 2.5] [--checkout DIR] [--repeats 1]

Starts seqgate on a free loopback port and opens `--streams` greedy chat streams of ShareGPT
first turns (prompts of 16-256 tokens, `--stream-tokens` new tokens each, EOS ignored so that
every stream is still running when the long prompts come; timed by their logprobs events, so that
a token whose text is held back still counts). Once every stream is decoding,
`--long` completions prompts of `--long-min`…`--long-max` tokens (cut from ShareGPT user text,
no two sharing a head) arrive evenly spread over `--arrival-seconds`, each asking for 16 tokens.

Per stream: the inter-token gaps (time between SSE content events), its median over the whole
stream, and its largest gap while the long prompts are prefilled (from the first one sent to one
second after the last one's first token). The figure of merit is the worst stream's largest gap
over its median; target (issue 10) at most 3. Also reported: TPOT p95 (over streams, each
stream's mean time per token after its first) and the long prompts' TTFT.

Each budget in `--budgets` runs this tree's server with `--max-num-batched-tokens` and the token
budget alone (`--stall-ratio 0`); each ratio in `--stall-ratios` runs it with the default budget
and `--stall-ratio` (prompt work per step bounded by learnt step costs); `--checkout
DIR` also runs another checkout's server (`python -m app serve` with DIR as working directory,
this interpreter) with its defaults, labelled "checkout", to measure an older commit in the same
run:
    git worktree add /tmp/before <commit>
    python -m bench.stall --checkout /tmp/before
Configurations alternate within each repeat. Results go to `--out` (JSON) and stdout (markdown).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx

from bench import provenance
from bench.harness import (
    CHECKOUT,
    Opt,
    StreamTrace,
    parse_args,
    pipe_table,
    publish,
    server_log,
    sse,
    trace,
    until_streaming,
)
from bench.servers import ServerProcess, ServerSpec, local_model_dir
from bench.sharegpt import load_requests, text_token_ids

LONG_NEW_TOKENS = 16


def workload(tokenizer, streams: int, long: int, lo: int, hi: int, seed: int
             ) -> tuple[list[list[dict]], list[list[int]]]:
    """The streams' chat messages and the long prompts' token ids (lengths spread lo…hi)."""
    reqs = load_requests(tokenizer, streams, seed=seed, min_prompt=16, max_prompt=256)
    lengths = [lo + round(i * (hi - lo) / max(long - 1, 1)) for i in range(long)]
    text = text_token_ids(tokenizer, sum(lengths) + 100 * long, seed=seed + 1)
    prompts, at = [], 0
    for n in lengths:
        prompts.append(text[at : at + n])
        at += n + 100  # no two prompts share a head, so the prefix cache cannot shortcut them
    return [r.messages for r in reqs], prompts


def _logprob_event(payload: str) -> bool:
    # Timed by logprobs, not text: a token without text yet (an incomplete character) still
    # sends its logprob, so a gap is a gap between tokens.
    if not (payload.startswith("{") and '"logprobs":{' in payload):
        return False
    choices = json.loads(payload)["choices"]
    return bool(choices and (choices[0].get("logprobs") or {}).get("content"))


async def _stream(client: httpx.AsyncClient, messages: list[dict], into: StreamTrace,
                  max_tokens: int) -> None:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "stream": True}
    await trace(client, "/v1/chat/completions", body, into, _logprob_event)


async def _long(client: httpx.AsyncClient, ids: list[int]) -> dict:
    body = {"prompt": ids, "max_tokens": LONG_NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent, first = time.perf_counter(), None
    async with sse(client, "/v1/completions", body) as stream:
        async for payload, at in stream:
            if first is None and payload.startswith("{") and '"text":""' not in payload:
                first = at
    return {"tokens": len(ids), "sent": sent, "first_token": first,
            "ttft_s": None if first is None else round(first - sent, 3)}


async def measure(url: str, messages: list[list[dict]], prompts: list[list[int]],
                  stream_tokens: int, arrival_seconds: float) -> dict:
    limits = httpx.Limits(max_connections=len(messages) + len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        traces = [StreamTrace() for _ in messages]
        tasks = [asyncio.create_task(_stream(client, m, t, stream_tokens))
                 for m, t in zip(messages, traces)]
        await until_streaming(traces, tasks, 5)
        window_start = time.perf_counter()
        longs = []
        for i, ids in enumerate(prompts):
            longs.append(asyncio.create_task(_long(client, ids)))
            if i < len(prompts) - 1:
                await asyncio.sleep(arrival_seconds / max(len(prompts) - 1, 1))
        long_results = await asyncio.gather(*longs)
        await asyncio.sleep(1.0)  # a stall right after the last prefill shows too
        window_end = max(r["first_token"] or 0.0 for r in long_results) + 1.0
        await asyncio.gather(*tasks)
    return summarize(traces, long_results, window_start, window_end)


def summarize(traces: list[StreamTrace], long_results: list[dict], window_start: float,
              window_end: float) -> dict:
    """Per stream: its median gap, its largest gap within the window and when it ended; over the
    streams: the worst largest-gap / median ratio, TPOT p95; the long prompts' TTFT."""
    rows = []
    for t in traces:
        gaps = t.gaps()
        median = statistics.median(gaps)
        during = t.gaps(window_start, window_end)
        ends = [b for a, b in zip(t.times, t.times[1:]) if window_start <= b <= window_end]
        worst_end = ends[during.index(max(during))] if during else None
        rows.append({"tokens": len(t.times), "median_gap_s": round(median, 4),
                     "max_gap_during_s": round(max(during), 4) if during else None,
                     # when that gap ended, in seconds after the first long prompt was sent
                     "max_gap_ended_at_s": None if worst_end is None
                     else round(worst_end - window_start, 3),
                     "max_over_median": round(max(during) / median, 2) if during else None,
                     "tpot_s": round((t.times[-1] - t.times[0]) / (len(t.times) - 1), 4),
                     "still_running_at_window_end": t.times[-1] > window_end})
    tpots = sorted(r["tpot_s"] for r in rows)
    ratios = [r["max_over_median"] for r in rows if r["max_over_median"] is not None]
    ttfts = sorted(r["ttft_s"] for r in long_results if r["ttft_s"] is not None)
    return {
        "streams": rows,
        "long_prompts": [{"tokens": r["tokens"], "sent_at_s": round(r["sent"] - window_start, 3),
                          "ttft_s": r["ttft_s"]} for r in long_results],
        "window_s": round(window_end - window_start, 2),
        "worst_max_over_median": max(ratios) if ratios else None,
        "worst_max_gap_s": max(r["max_gap_during_s"] or 0 for r in rows),
        "median_gap_s": statistics.median(r["median_gap_s"] for r in rows),
        "tpot_p95_s": tpots[min(len(tpots) - 1, round(0.95 * (len(tpots) - 1)))],
        "long_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "long_ttft_max_s": ttfts[-1] if ttfts else None,
        "streams_outlasting_window": sum(r["still_running_at_window_end"] for r in rows),
    }


def report(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        m = r["result"]
        verdict = "met" if m["worst_max_over_median"] <= 3 else "not met"
        rows.append([r["label"], r["repeat"], f"{m['worst_max_over_median']:.2f} ({verdict})",
                     f"{m['worst_max_gap_s']:.3f} s", f"{m['median_gap_s'] * 1e3:.0f} ms",
                     f"{m['tpot_p95_s'] * 1e3:.0f} ms",
                     f"{m['long_ttft_p50_s']:.2f} s / {m['long_ttft_max_s']:.2f} s",
                     f"{m['streams_outlasting_window']}/{len(m['streams'])}"])
    return "\n".join(pipe_table(
        ["server", "repeat", "worst largest gap / median (target <= 3)", "worst largest gap",
         "median gap", "TPOT p95", "long-prompt TTFT p50 / max",
         "streams outlasting the window"], rows))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(
        __doc__, "stall", argv, streams=16, stream_tokens=320, long=8, long_min=1000,
        long_max=1800, arrival_seconds=3.0,
        budgets=Opt("128,256", help="comma-separated --max-num-batched-tokens values for this "
                                    "tree, each with --stall-ratio 0"),
        stall_ratios=Opt("2.5", help="comma-separated --stall-ratio values for this tree"),
        checkout=CHECKOUT, repeats=1, seed=0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_model_dir())
    messages, prompts = workload(tokenizer, args.streams, args.long, args.long_min,
                                 args.long_max, args.seed)
    configs: list[ServerSpec] = []
    if args.checkout is not None:
        configs.append(ServerSpec(f"commit {provenance.commit_of(args.checkout)}", "app",
                                  checkout=args.checkout))
    for b in [int(x) for x in args.budgets.split(",") if x.strip()]:
        configs.append(ServerSpec(f"budget {b}", "app", ("--max-num-batched-tokens", str(b),
                                                         "--stall-ratio", "0")))
    for r in [float(x) for x in args.stall_ratios.split(",") if x.strip()]:
        configs.append(ServerSpec(f"stall ratio {r:g}", "app", ("--stall-ratio", str(r))))
    runs = []
    for repeat in range(args.repeats):
        for spec in configs:
            with ServerProcess(spec, None, server_log(args.out, spec.label),
                               stop_timeout=60) as server:
                result = asyncio.run(measure(server.base_url, messages, prompts,
                                             args.stream_tokens, args.arrival_seconds))
            runs.append({"label": spec.label, "repeat": repeat, "result": result})
            print(f"[stall] {spec.label} repeat {repeat}: worst gap/median "
                  f"{result['worst_max_over_median']}", flush=True)
    data = {"meta": provenance.meta(argv, "bench.stall", args), "runs": runs}
    publish(data, args.out, report(runs), args.doc, "Long prompts arriving while streams decode",
            f"{args.streams} streams, {args.long} prompts of {args.long_min}-{args.long_max} "
            f"tokens over {args.arrival_seconds} s.")


if __name__ == "__main__":
    main()
