"""Output tokens/s of contrastive search against greedy on the engine, in one process.

    python -m bench.studies.contrastive [--num-prompts 32] [--max-tokens 64] [--top-k 4]
                                        [--threads N]

The same ShareGPT prompts run once per strategy, every request submitted at once to a background
engine whose rolling batch holds them all (concurrency = --num-prompts). Every request generates
exactly --max-tokens (EOS blocked until then), so both strategies produce equal token counts.
Writes bench/results/contrastive.json.

It uses only the engine's public API, so it also measures another checkout's engine: run it as a
file with PYTHONPATH pointing to that checkout (`PYTHONPATH=<checkout> python
bench/studies/contrastive.py --out <path>`, from a directory that is not a checkout; the checkout
must hold bench/studies/common.py and bench/harness.py, or run an older copy of this file there).
"""

from __future__ import annotations

from bench.harness import markdown_table
from bench.provenance import jsonable
from bench.sharegpt import load_requests
from bench.studies.common import (
    base_parser,
    env_info,
    load,
    make_engine,
    run_engine,
    write_json,
)
from engine import SamplingParams


def params(strategy: str, n: int, top_k: int, alpha: float) -> SamplingParams:
    extra = {"top_k": top_k, "penalty_alpha": alpha} if strategy == "contrastive" else {}
    return SamplingParams(strategy=strategy, max_new_tokens=n, min_new_tokens=n, **extra)


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32, help="requests, all at once")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--max-prompt", type=int, default=512, help="longest prompt, in tokens")
    ap.add_argument("--strategies", default="greedy,contrastive")
    ap.add_argument("--top-k", type=int, default=4, help="contrastive candidates")
    ap.add_argument("--penalty-alpha", type=float, default=0.6)
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens = 4, 8

    loaded = load(args.threads, args.device, args.dtype)
    reqs = load_requests(loaded.tokenizer, args.num_prompts, seed=args.seed,
                         max_prompt=args.max_prompt)
    prompts = [r.prompt_ids for r in reqs]
    print(f"{len(reqs)} ShareGPT prompts, {sum(map(len, prompts)):,} prompt tokens, "
          f"{args.max_tokens} new tokens each; threads={args.threads}")
    rows = []
    for strategy in args.strategies.split(","):
        eng, rec = make_engine(loaded, args.threads, max_rolling_batch_size=len(reqs))
        warm = params(strategy, 2, args.top_k, args.penalty_alpha)
        run_engine(eng, [(prompts[0], warm)])  # first-call costs stay out of the figure
        rec.steps.clear()
        p = params(strategy, args.max_tokens, args.top_k, args.penalty_alpha)
        out, seconds = run_engine(eng, [(ids, p) for ids in prompts])
        eng.stop()
        tokens = sum(map(len, out))
        assert tokens == len(reqs) * args.max_tokens, "a request stopped short"
        st = rec.summary()
        step_ms = 1e3 * (st["pure_decode_step_seconds"]["mean"] or 0)
        rows.append([strategy, tokens, seconds, tokens / seconds, step_ms])
        print(f"{strategy}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tokens/s; "
              f"pure decode step {step_ms:.0f} ms mean over {st['pure_decode_steps']} steps")
    base = rows[0][3]
    for r in rows:
        r.append(r[3] / base)
    headers = ["strategy", "output tokens", "seconds", "tokens/s", "decode step ms",
               f"vs {rows[0][0]}"]
    print()
    print(markdown_table(headers, rows))
    results = {"args": jsonable(args), "env": env_info(loaded, args.threads),
               "results": [dict(zip(headers, r)) for r in rows]}
    path = write_json("contrastive", results, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
