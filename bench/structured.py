"""What structured outputs cost the batch (issue 11): JSON-schema requests against the same requests
without a schema, and what a never-seen schema adds to its own first token and to other streams.

    python -m bench.structured [--concurrency 32] [--requests 96] [--max-tokens 96]
                               [--fresh 8] [--streams 16] [--doc docs/benchmarks/structured.md]

Starts seqgate (`python -m app serve`) on a free loopback port.

1. Throughput: `--requests` ShareGPT first turns at `--concurrency`, streamed, greedy, twice:
   without `response_format`, and with a JSON-schema `response_format` (a title, one to three
   enum tags, and an answer string of at least `ANSWER_MIN_CHARS` characters). The answer's
   minimum length keeps every constrained request generating until `--max-tokens`, and the free
   requests ignore EOS, so both runs generate the same number of tokens and the ratio of output
   tokens/s is the cost of constraining (target: at least 0.85). The two kinds run in the order
   free, constrained, constrained, free (drift in the machine's speed cancels) with the prefix
   cache off (both kinds send the same prompts: the second would find them cached), and each
   kind's figures pool its two runs. The per-token mask cost comes from the server's own counters
   (seqgate_grammar_mask_seconds / seqgate_grammar_masked_tokens).
2. New schemas: while `--streams` free streams decode, `--fresh` requests each bring a schema the
   server has never seen (distinct property names), one after another; then the same requests are
   sent again (their schemas now compiled and cached). Reported: their TTFT both times (the
   difference is what compiling adds) and every stream's largest inter-token gap over its median
   while the new schemas arrive (compiling happens on request threads, not the engine's, so this
   should stay near a normal step's variation).

Both phases run on one server; figures compare within this run only.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from bench import harness, provenance
from bench.loadgen import closed_loop
from bench.scrape import scrape
from bench.servers import ServerProcess, ServerSpec, local_model_dir
from bench.sharegpt import load_requests

ANSWER_MIN_CHARS = 4000  # longer than any --max-tokens answer: constrained requests run to length


def answer_schema(suffix: str = "") -> dict:
    """The schema every constrained request carries; `suffix` renames its properties, which makes
    a schema the server has not compiled yet."""
    return {"type": "object", "properties": {
        f"title{suffix}": {"type": "string", "maxLength": 80},
        f"tags{suffix}": {"type": "array", "minItems": 1, "maxItems": 3,
                          "items": {"enum": ["question", "code", "writing", "math", "other"]}},
        f"answer{suffix}": {"type": "string", "minLength": ANSWER_MIN_CHARS}},
        "required": [f"title{suffix}", f"tags{suffix}", f"answer{suffix}"],
        "additionalProperties": False}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def bodies(messages: list[list[dict]], max_tokens: int, constrained: bool) -> list[dict]:
    base = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if constrained:
        extra = {"response_format": response_format(answer_schema())}
    else:
        extra = {"ignore_eos": True}
    return [{"messages": m, **base, **extra} for m in messages]


def throughput(url: str, messages: list[list[dict]], max_tokens: int, concurrency: int,
               constrained: bool) -> dict:
    before = scrape(url)
    results, wall = asyncio.run(closed_loop(url, "/v1/chat/completions",
                                            bodies(messages, max_tokens, constrained),
                                            concurrency))
    after = scrape(url)
    failed = [r.error for r in results if not r.ok]
    tokens = sum(r.output_tokens for r in results if r.ok)
    ttfts = sorted(r.ttft for r in results if r.ttft is not None)
    masked = after.get("seqgate_grammar_masked_tokens_total", 0) - \
        before.get("seqgate_grammar_masked_tokens_total", 0)
    mask_s = after.get("seqgate_grammar_mask_seconds_total", 0) - \
        before.get("seqgate_grammar_mask_seconds_total", 0)
    return {"constrained": constrained, "requests": len(results), "failed": len(failed),
            "errors": failed[:3], "output_tokens": tokens, "wall_s": round(wall, 2),
            "output_tokens_per_s": round(tokens / wall, 2),
            "finish_reasons": dict(sorted(_count(r.finish_reason for r in results).items())),
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "masked_tokens": int(masked),
            "mask_us_per_token": round(mask_s / masked * 1e6, 1) if masked else None}


def pooled(runs: list[dict]) -> dict:
    """One kind's runs as one: tokens, wall time and masked tokens add up; the TTFT p50 and the
    mask cost are the runs' mean."""
    tokens, wall = sum(r["output_tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    masks = [r["mask_us_per_token"] for r in runs if r["mask_us_per_token"] is not None]
    finish: dict = {}
    for r in runs:
        for k, v in r["finish_reasons"].items():
            finish[k] = finish.get(k, 0) + v
    return {"constrained": runs[0]["constrained"], "runs": len(runs),
            "requests": sum(r["requests"] for r in runs),
            "failed": sum(r["failed"] for r in runs), "output_tokens": tokens,
            "wall_s": round(wall, 2), "output_tokens_per_s": round(tokens / wall, 2),
            "finish_reasons": finish,
            "ttft_p50_s": round(statistics.mean(r["ttft_p50_s"] for r in runs), 3),
            "mask_us_per_token": round(statistics.mean(masks), 1) if masks else None}


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


async def _free_stream(client: httpx.AsyncClient, messages: list[dict],
                       into: harness.StreamTrace, max_tokens: int) -> None:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "stream": True}
    await harness.trace(client, "/v1/chat/completions", body, into,
                        lambda p: p.startswith("{") and '"logprobs":{' in p)


async def _ttft(client: httpx.AsyncClient, messages: list[dict], schema: dict) -> float:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True,
            "response_format": response_format(schema)}
    sent = time.perf_counter()
    async with harness.sse(client, "/v1/chat/completions", body) as stream:
        async for payload, at in stream:
            if payload.startswith("{") and '"content":""' not in payload:
                return at - sent
    raise RuntimeError("no content came back")


async def new_schemas(url: str, streams: list[list[dict]], probe: list[dict], fresh: int,
                      stream_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=len(streams) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        traces = [harness.StreamTrace() for _ in streams]
        tasks = [asyncio.create_task(_free_stream(client, m, t, stream_tokens))
                 for m, t in zip(streams, traces)]
        await harness.until_streaming(traces, tasks, 5)
        schemas = [answer_schema(f"_{time.time_ns()}_{i}") for i in range(fresh)]
        t0 = time.perf_counter()
        first = [await _ttft(client, probe, s) for s in schemas]
        t1 = time.perf_counter()
        cached = [await _ttft(client, probe, s) for s in schemas]
        t2 = time.perf_counter()
        await asyncio.gather(*tasks)
    fresh_ratios, cached_ratios = _gap_ratios(traces, t0, t1), _gap_ratios(traces, t1, t2)
    return {"fresh_ttft_s": [round(x, 3) for x in first],
            "cached_ttft_s": [round(x, 3) for x in cached],
            "fresh_ttft_p50_s": round(statistics.median(first), 3),
            "cached_ttft_p50_s": round(statistics.median(cached), 3),
            "added_by_compiling_p50_ms": round((statistics.median(first)
                                                - statistics.median(cached)) * 1e3, 1),
            # While the new schemas arrive, then while the same (cached) ones do: the difference
            # is what compiling does to the running streams.
            "streams_worst_gap_over_median": max(fresh_ratios, default=None),
            "streams_median_gap_over_median": _median(fresh_ratios),
            "cached_streams_worst_gap_over_median": max(cached_ratios, default=None),
            "cached_streams_median_gap_over_median": _median(cached_ratios),
            "window_s": round(t1 - t0, 2)}


def _gap_ratios(traces: list[harness.StreamTrace], start: float, end: float) -> list[float]:
    """Each stream's largest inter-token gap within [start, end] over its median gap."""
    out = []
    for t in traces:
        during = t.gaps(start, end)
        if during:
            out.append(round(max(during) / statistics.median(t.gaps()), 2))
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def report(data: dict) -> str:
    free, constrained = data["throughput"]
    ratio = constrained["output_tokens_per_s"] / free["output_tokens_per_s"]
    verdict = "met" if ratio >= 0.85 else "not met"
    rows = []
    for r in (free, constrained):
        name = "JSON schema" if r["constrained"] else "no schema (ignore_eos)"
        mask = f"{r['mask_us_per_token']} µs" if r["mask_us_per_token"] is not None else "-"
        rows.append([f"{name} ({r.get('runs', 1)})", f"{r['requests']} ({r['failed']} failed)",
                     r["output_tokens"], f"{r['wall_s']} s", r["output_tokens_per_s"],
                     f"{r['ttft_p50_s']} s", r["finish_reasons"], mask])
    lines = harness.pipe_table(["kind (runs pooled)", "requests", "output tokens", "wall",
                                "output tokens/s", "TTFT p50", "finish reasons",
                                "mask cost per token"], rows)
    lines.append(f"\nConstrained / free output tokens/s: **{ratio:.3f}** (target >= 0.85: "
                 f"{verdict}).")
    n = data["new_schemas"]
    lines.append(
        f"\nNever-seen schemas ({len(n['fresh_ttft_s'])}, one after another, while "
        f"{data['meta']['args']['streams']} streams decode): TTFT p50 {n['fresh_ttft_p50_s']} s "
        f"when new, {n['cached_ttft_p50_s']} s once cached (compiling adds "
        f"{n['added_by_compiling_p50_ms']} ms at the median). The decoding streams' largest "
        f"inter-token gap over their median while the new schemas arrive: worst stream "
        f"{n['streams_worst_gap_over_median']}×, median stream "
        f"{n['streams_median_gap_over_median']}×; while the same requests come again with "
        f"their schemas cached: {n.get('cached_streams_worst_gap_over_median')}× and "
        f"{n.get('cached_streams_median_gap_over_median')}×.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = harness.parse_args(__doc__, "structured", argv, concurrency=32, requests=96,
                              max_tokens=96, fresh=8, streams=16, stream_tokens=200, seed=0,
                              server_arg=harness.SERVER_ARG)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_model_dir())
    reqs = load_requests(tokenizer, args.requests + args.streams + 1, seed=args.seed,
                         min_prompt=16, max_prompt=512)
    messages = [r.messages for r in reqs]
    spec = ServerSpec("seqgate", "app", ("--max-rolling-batch-size", str(args.concurrency),
                                         "--prompt-cache-bytes", "0", *args.server_arg))
    log = harness.server_log(args.out, "server")
    with ServerProcess(spec, None, log, stop_timeout=60) as server:
        url = server.base_url
        work = messages[: args.requests]
        asyncio.run(closed_loop(url, "/v1/chat/completions",
                                bodies(work[:8], 8, True) + bodies(work[:8], 8, False), 8))
        runs = [throughput(url, work, args.max_tokens, args.concurrency, c)
                for c in (False, True, True, False)]
        fresh = asyncio.run(new_schemas(url, messages[args.requests:-1], messages[-1],
                                        args.fresh, args.stream_tokens))
    data = {"meta": provenance.meta(argv, "bench.structured", args),
            "runs": runs, "throughput": [pooled([r for r in runs if r["constrained"] == c])
                                         for c in (False, True)],
            "new_schemas": fresh}
    harness.publish(data, args.out, report(data), args.doc, "Structured outputs under load",
            f"{args.requests} ShareGPT chats at concurrency {args.concurrency}, "
            f"{args.max_tokens} tokens each, prefix cache off, each kind run twice (free, "
            f"constrained, constrained, free).")


if __name__ == "__main__":
    main()
