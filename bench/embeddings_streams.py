"""Do embedding requests slow the chat streams? (issue 32, part 4)

    python -m bench.embeddings_streams [--streams 4] [--stream-tokens 200] [--embed-clients 2]
                                       [--embed-batch 16] [--server-arg=--embedding-threads=1]

Starts seqgate with `--embedding-model all-minilm-l6-v2` on a free loopback port and runs
`--streams` greedy chat streams (ShareGPT first turns, EOS ignored, timed by their logprobs
events) twice: alone, then with `--embed-clients` clients sending embedding requests back to back
(`--embed-batch` ShareGPT texts each, cut to about `--embed-words` words) for as long as the
streams run. Reported per phase: the streams' inter-token gap, median and p95 (over all gaps of
all streams) and largest, and with embeddings the ratios to the phase without them; the target
(issue 32) is a largest gap within 3× the median. Also the embedding requests' throughput and
latency. Results go to `--out` (JSON) and stdout (markdown).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from bench import provenance
from bench.harness import (
    SERVER_ARG,
    StreamTrace,
    parse_args,
    pipe_table,
    publish,
    server_log,
    trace,
)
from bench.servers import ServerProcess, ServerSpec, local_model_dir
from bench.sharegpt import load_requests
from bench.stall import _logprob_event

EMBEDDING_MODEL = "all-minilm-l6-v2"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _stream(client: httpx.AsyncClient, messages: list[dict], into: StreamTrace,
                  max_tokens: int) -> None:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "stream": True}
    await trace(client, "/v1/chat/completions", body, into, _logprob_event)


async def _embedder(client: httpx.AsyncClient, texts: list[str], stop: asyncio.Event,
                    latencies: list[float], inputs: list[int]) -> None:
    """Embedding requests back to back until `stop`; each one's latency and input count."""
    while not stop.is_set():
        sent = time.perf_counter()
        resp = await client.post("/v1/embeddings", json={"input": texts})
        resp.raise_for_status()
        latencies.append(time.perf_counter() - sent)
        inputs.append(len(texts))


async def phase(url: str, messages: list[list[dict]], stream_tokens: int,
                batches: list[list[str]]) -> dict:
    """The streams, with one embedding client per batch in `batches` (none: alone)."""
    limits = httpx.Limits(max_connections=len(messages) + len(batches) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        traces = [StreamTrace() for _ in messages]
        stop, latencies, inputs = asyncio.Event(), [], []
        embedders = [asyncio.create_task(_embedder(client, b, stop, latencies, inputs))
                     for b in batches]
        started = time.perf_counter()
        await asyncio.gather(*(_stream(client, m, t, stream_tokens)
                               for m, t in zip(messages, traces)))
        elapsed = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*embedders)
    return summarize(traces, latencies, inputs, elapsed)


def summarize(traces: list[StreamTrace], latencies: list[float], inputs: list[int],
              elapsed: float) -> dict:
    gaps = [g for t in traces for g in t.gaps()]
    out = {"gap_median_s": statistics.median(gaps), "gap_p95_s": percentile(gaps, 0.95),
           "gap_max_s": max(gaps), "gaps": len(gaps), "seconds": round(elapsed, 2)}
    if latencies:
        out.update(embed_requests=len(latencies), embed_inputs_per_s=sum(inputs) / elapsed,
                   embed_latency_p50_s=statistics.median(latencies),
                   embed_latency_p95_s=percentile(latencies, 0.95))
    return out


def compare(alone: dict, loaded: dict) -> dict:
    base = alone["gap_median_s"]
    return {"median_ratio": loaded["gap_median_s"] / base,
            "p95_ratio": loaded["gap_p95_s"] / alone["gap_p95_s"],
            "max_over_alone_median": loaded["gap_max_s"] / base}


def report(alone: dict, loaded: dict, ratios: dict) -> str:
    def ms(x: float) -> str:
        return f"{x * 1e3:.0f} ms"

    rows = [["streams alone", ms(alone["gap_median_s"]), ms(alone["gap_p95_s"]),
             ms(alone["gap_max_s"]), "-", "-"],
            ["with embeddings", ms(loaded["gap_median_s"]), ms(loaded["gap_p95_s"]),
             ms(loaded["gap_max_s"]), f"{loaded.get('embed_inputs_per_s', 0):.1f}",
             ms(loaded.get("embed_latency_p95_s", 0))]]
    verdict = "met" if ratios["max_over_alone_median"] <= 3 else "not met"
    return "\n".join([*pipe_table(["phase", "gap median", "gap p95", "gap max",
                                   "embedded inputs/s", "embedding p95"], rows), "",
                      f"median ×{ratios['median_ratio']:.2f}, p95 ×{ratios['p95_ratio']:.2f}; "
                      f"largest gap / median alone {ratios['max_over_alone_median']:.2f} "
                      f"(target <= 3: {verdict})"])


def workload(streams: int, clients: int, batch: int, words: int, seed: int
             ) -> tuple[list[list[dict]], list[list[str]]]:
    """The streams' messages and each embedding client's texts (ShareGPT first turns)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_model_dir())
    reqs = load_requests(tokenizer, streams + clients * batch, seed=seed, min_prompt=16,
                         max_prompt=256)
    messages = [r.messages for r in reqs[:streams]]
    texts = [" ".join(r.messages[-1]["content"].split()[:words]) for r in reqs[streams:]]
    return messages, [texts[i * batch:(i + 1) * batch] for i in range(clients)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, "embeddings_streams", argv, streams=4, stream_tokens=200,
                      embed_clients=2, embed_batch=16, embed_words=60, seed=0,
                      server_arg=SERVER_ARG)
    messages, batches = workload(args.streams, args.embed_clients, args.embed_batch,
                                 args.embed_words, args.seed)
    spec = ServerSpec("seqgate", "app", ("--embedding-model", EMBEDDING_MODEL,
                                         *args.server_arg))
    with ServerProcess(spec, None, server_log(args.out, spec.label), stop_timeout=60) as server:
        alone = asyncio.run(phase(server.base_url, messages, args.stream_tokens, []))
        loaded = asyncio.run(phase(server.base_url, messages, args.stream_tokens, batches))
    ratios = compare(alone, loaded)
    data = {"meta": provenance.meta(argv, "bench.embeddings_streams", args),
            "alone": alone, "with_embeddings": loaded, "ratios": ratios}
    publish(data, args.out, report(alone, loaded, ratios), args.doc,
            "Chat streams with and without embedding requests",
            f"{args.streams} streams of {args.stream_tokens} tokens; {args.embed_clients} "
            f"embedding clients of {args.embed_batch} texts.")


if __name__ == "__main__":
    main()
