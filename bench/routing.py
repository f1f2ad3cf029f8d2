"""Routing over engine replicas (`seqgate serve --replicas N`): where shared prompts land, how
much of them the replicas' prefix caches serve, and what the hop through Ray Serve costs.

    python -m bench.routing [--replicas 2] [--prompts 4] [--per-prompt 16]
                            [--system-tokens 400] [--concurrency 8] [--latency-requests 60]
                            [--policies prefix_affinity,least_loaded,round_robin] [--model DIR]

Routing: for each router policy a fresh `seqgate serve --replicas N --router POLICY` (its own
local Ray) gets `--prompts` distinct system prompts of `--system-tokens` tokens, each asked
`--per-prompt` short questions (each prompt's first question alone, then the rest interleaved,
`--concurrency` at a time), greedy, 4 new tokens. Reported per policy: the fraction of prompt
tokens served from a prefix cache (`usage.prompt_tokens_details.cached_tokens`), how many
replicas each prompt's requests went to (from the `x-seqgate-replica` header), and the wall time.
A single server (`--replicas 1`) runs the same workload as the reference.

Added latency: `--latency-requests` one-token completions of a short prompt, one at a time,
against the single server and against the replicas (prefix_affinity); p50 / p95 of each and of
the difference. On a small machine this is the cost of the extra hop (gateway → Ray → replica)
and the router's decision; throughput scaling needs a machine with cores for every replica.
Results go to `--out` (JSON) and stdout (markdown); `--doc` also writes the report there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections import defaultdict
from pathlib import Path

import httpx

from bench import provenance
from bench.harness import Opt, markdown_table, parse_args, publish
from bench.servers import SEQGATE, ServerProcess, local_model_dir
from bench.workloads import distinct_system_prompts

CHAT_PATH = "/v1/chat/completions"
POLICIES = ("prefix_affinity", "least_loaded", "round_robin")


async def ask(http: httpx.AsyncClient, model: str | None, system: str, question: int) -> dict:
    body = {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Question {question}."}]}
    r = await http.post(CHAT_PATH, json=body)
    r.raise_for_status()
    usage = r.json()["usage"]
    return {"replica": r.headers.get("x-seqgate-replica", "single"),
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def shared_prompts(server: ServerProcess, prompts: list[str], per_prompt: int,
                         concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    answers: dict[int, list[dict]] = defaultdict(list)

    async def one(http, k: int, i: int) -> None:
        async with limit:
            answers[k].append(await ask(http, server.request_model, prompts[k], i))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
        await asyncio.gather(*(one(http, k, 0) for k in range(len(prompts))))
        await asyncio.gather(*(one(http, k, i) for i in range(1, per_prompt)
                               for k in range(len(prompts))))
    flat = [a for rows in answers.values() for a in rows]
    return {
        "wall_seconds": time.perf_counter() - t0,
        "cached_fraction": sum(a["cached_tokens"] for a in flat) /
                           sum(a["prompt_tokens"] for a in flat),
        "replicas_per_prompt": [len({a["replica"] for a in answers[k]})
                                for k in sorted(answers)],
        "requests_per_replica": dict(sorted(
            {r: sum(a["replica"] == r for a in flat) for r in {a["replica"] for a in flat}}
            .items())),
    }


async def latencies(server: ServerProcess, n: int) -> list[float]:
    body = {"model": server.request_model, "prompt": "The capital of France is",
            "max_tokens": 1, "temperature": 0}
    out = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        for _ in range(n + 3):  # the first three warm the path and are dropped
            t0 = time.perf_counter()
            (await http.post("/v1/completions", json=body)).raise_for_status()
            out.append(time.perf_counter() - t0)
    return out[3:]


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] \
        if len(values) > 1 else values[0]


def report(data: dict) -> str:
    rows = [[label, f"{r['cached_fraction']:.1%}", " ".join(map(str, r["replicas_per_prompt"])),
             " ".join(f"{v}" for v in r["requests_per_replica"].values()),
             f"{r['wall_seconds']:.1f}"] for label, r in data["routing"].items()]
    lat = data["latency"]
    lat_rows = [[label, f"{v['p50'] * 1000:.1f}", f"{v['p95'] * 1000:.1f}"]
                for label, v in lat.items()]
    return "\n\n".join([
        markdown_table(["server", "cached prompt tokens", "replicas per prompt",
                        "requests per replica", "wall s"], rows),
        markdown_table(["one-token completion", "p50 ms", "p95 ms"], lat_rows),
    ])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(
        __doc__, "routing", argv, replicas=2, prompts=4, per_prompt=16, system_tokens=400,
        concurrency=8, latency_requests=60, policies=",".join(POLICIES),
        model=Opt(None, Path, "model directory (default: the embedded model's safetensors copy)"))
    from transformers import AutoTokenizer

    model_dir = args.model or local_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    single = dataclasses.replace(SEQGATE, label="single server")
    specs = [(single, None)] + [
        (dataclasses.replace(SEQGATE, label=f"{args.replicas} replicas, {policy}", extra_args=(
            "--replicas", str(args.replicas), "--router", policy)), policy)
        for policy in args.policies.split(",")]
    routing, latency = {}, {}
    for seed, (spec, policy) in enumerate(specs):
        log = args.out.with_suffix(f".{policy or 'single'}.log")
        with ServerProcess(spec, model_dir, log) as server:
            # New prompts per server: nothing is cached anywhere when a run starts.
            prompts = distinct_system_prompts(tokenizer, args.prompts, args.system_tokens, seed)
            routing[spec.label] = asyncio.run(shared_prompts(server, prompts, args.per_prompt,
                                                             args.concurrency))
            if policy in (None, "prefix_affinity") and args.latency_requests:
                latency[spec.label] = asyncio.run(latencies(server, args.latency_requests))
        print(f"[routing] {spec.label}: {routing[spec.label]}", flush=True)
    summary = {label: {"p50": pct(v, 50), "p95": pct(v, 95)} for label, v in latency.items()}
    if len(summary) == 2:
        base, routed = summary.values()
        summary["added by the replicas"] = {q: routed[q] - base[q] for q in ("p50", "p95")}
    data = {"meta": provenance.meta(argv, "bench.routing", args),
            "routing": routing, "latency": summary, "latency_samples": latency}
    publish(data, args.out, report(data), args.doc, "Routing over replicas",
            f"{args.prompts} system prompts of {args.system_tokens} tokens x {args.per_prompt} "
            f"questions, {args.replicas} replicas;")


if __name__ == "__main__":
    main()
