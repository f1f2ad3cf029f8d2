"""Multi-turn chats and the prefix cache: time to first token of later turns, cache on and off.

    python -m bench.multiturn [--conversations 32] [--concurrency 8] [--repeats 1]

ShareGPT conversations with at least three human turns (each at most `--max-turn-tokens`
tokens). Every turn is sent as chat clients send it: the whole history, the model's own earlier
answers included, streamed, greedy, at most `--max-tokens` new tokens. `--concurrency`
conversations run at once, each one's turns in order. The same conversations run on seqgate
(radix prefix cache on, the default) and on seqgate with `--prompt-cache-bytes 0`, interleaved
A B A B over `--repeats`, on free loopback ports. Reported per server and turn: TTFT p50 / p95
and the fraction of prompt tokens whose KV came from the cache
(`usage.prompt_tokens_details.cached_tokens`). Target (issue 10): TTFT p50 of turns 2 and 3 at
least 3x lower with the cache. Results go to `--out` (JSON) and stdout (markdown).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

import httpx

from bench import provenance
from bench.harness import machine_line, parse_args, pipe_table, publish, server_log
from bench.loadgen import send
from bench.servers import SEQGATE, ServerProcess, local_model_dir
from bench.sharegpt import load_conversations

CHAT_PATH = "/v1/chat/completions"
TURNS = 3


@dataclass
class TurnResult:
    conversation: int
    turn: int  # 1-based
    ttft: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None = None


@dataclass
class ServerRun:
    label: str
    repeat: int
    wall_seconds: float = 0.0
    turns: list[TurnResult] = field(default_factory=list)


def conversations(tokenizer, count: int, max_turn_tokens: int) -> list[list[str]]:
    """The first `TURNS` human turns of `count` ShareGPT conversations (in file order), each turn
    non-empty and at most `max_turn_tokens` tokens."""
    out = []
    for conv in load_conversations():
        humans = [t.get("value") or "" for t in conv.get("conversations") or []
                  if t.get("from") == "human"][:TURNS]
        if len(humans) < TURNS or not all(h.strip() for h in humans):
            continue
        if any(len(tokenizer.encode(h, add_special_tokens=False)) > max_turn_tokens
               for h in humans):
            continue
        out.append(humans)
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} ShareGPT conversations qualify; {count} asked for")


async def run_conversations(base_url: str, model: str | None, convs: list[list[str]],
                            concurrency: int, max_tokens: int) -> tuple[list[TurnResult], float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[TurnResult] = []
    queue = iter(range(len(convs)))
    async with httpx.AsyncClient(base_url=base_url, limits=limits,
                                 timeout=httpx.Timeout(3600.0, connect=30.0)) as client:

        async def worker() -> None:
            for c in queue:
                history: list[dict[str, str]] = []
                for t, user in enumerate(convs[c], 1):
                    history.append({"role": "user", "content": user})
                    body = {"model": model, "messages": list(history), "max_tokens": max_tokens,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
                    res = await send(client, CHAT_PATH, body, c, keep_text=True)
                    results.append(TurnResult(c, t, res.ttft, res.prompt_tokens,
                                              res.cached_tokens, res.error))
                    if res.error is not None:
                        break
                    history.append({"role": "assistant", "content": res.text})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(convs)))))
        return results, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(runs: list[ServerRun]) -> dict:
    """Per server label and turn: TTFT p50/p95 (all repeats pooled), cached fraction, errors."""
    out: dict = {}
    for label in dict.fromkeys(r.label for r in runs):
        turns = [t for r in runs if r.label == label for t in r.turns]
        per_turn = {}
        for n in range(1, TURNS + 1):
            ok = [t for t in turns if t.turn == n and t.error is None and t.ttft is not None]
            prompt = sum(t.prompt_tokens or 0 for t in ok)
            per_turn[n] = {
                "requests": len(ok),
                "errors": sum(t.turn == n and t.error is not None for t in turns),
                "ttft_p50": _pct([t.ttft for t in ok], 0.5),
                "ttft_p95": _pct([t.ttft for t in ok], 0.95),
                "prompt_tokens_mean": prompt / len(ok) if ok else None,
                "cached_fraction": sum(t.cached_tokens or 0 for t in ok) / prompt
                if prompt else None,
            }
        out[label] = per_turn
    return out


def report(summary: dict, on: str, off: str) -> str:
    rows = []
    for label, turns in summary.items():
        for n, t in turns.items():
            frac = "n/a" if t["cached_fraction"] is None else f"{100 * t['cached_fraction']:.1f}%"
            p50 = "n/a" if t["ttft_p50"] is None else f"{t['ttft_p50']:.3f} s"
            p95 = "n/a" if t["ttft_p95"] is None else f"{t['ttft_p95']:.3f} s"
            mean = "n/a" if t["prompt_tokens_mean"] is None else f"{t['prompt_tokens_mean']:.0f}"
            rows.append([label, n, t["requests"], mean, frac, p50, p95])
    lines = pipe_table(["server", "turn", "requests", "prompt tokens (mean)", "cached",
                        "TTFT p50", "TTFT p95"], rows)
    lines.append("")
    for n in range(2, TURNS + 1):
        a, b = summary[off][n]["ttft_p50"], summary[on][n]["ttft_p50"]
        if a and b:
            verdict = "met" if a / b >= 3 else "not met"
            lines.append(f"- turn {n}: TTFT p50 cache off / on = {a / b:.2f}x (target >= 3x: "
                         f"{verdict})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, "multiturn", argv, conversations=32, concurrency=8, max_tokens=64,
                      max_turn_tokens=256, repeats=1)
    from transformers import AutoTokenizer

    model_dir = local_model_dir()
    convs = conversations(AutoTokenizer.from_pretrained(model_dir), args.conversations,
                          args.max_turn_tokens)
    on = SEQGATE
    off = dataclasses.replace(SEQGATE, label="seqgate cache off",
                              extra_args=("--prompt-cache-bytes", "0"))
    runs: list[ServerRun] = []
    for repeat in range(args.repeats):
        for spec in (on, off):
            with ServerProcess(spec, model_dir, server_log(args.out, spec.label)) as server:
                results, wall = asyncio.run(run_conversations(
                    server.base_url, server.request_model, convs, args.concurrency,
                    args.max_tokens))
            runs.append(ServerRun(spec.label, repeat, wall, results))
            print(f"[multiturn] {spec.label} repeat {repeat}: {len(results)} turns in "
                  f"{wall:.1f} s", flush=True)
    summary = summarize(runs)
    data = {"meta": provenance.meta(argv, "bench.multiturn", args),
            "summary": summary,
            "runs": [{"label": r.label, "repeat": r.repeat, "wall_seconds": r.wall_seconds,
                      "turns": [vars(t) for t in r.turns]} for r in runs]}
    meta = data["meta"]
    publish(data, args.out, report(summary, on.label, off.label), args.doc,
            f"Multi-turn conversations, radix prefix cache on and off (`{meta['command']}`)",
            intro=f"{args.conversations} three-turn ShareGPT conversations, "
                  f"{args.concurrency} at once, at most {args.max_tokens} tokens per answer; "
                  f"{machine_line(meta)}.")


if __name__ == "__main__":
    main()
