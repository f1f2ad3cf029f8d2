"""Speculative decoding by prompt lookup: output tokens/s with it on and off, in one process.

    python -m bench.studies.speculative [--num-prompts 12] [--max-tokens 128]
                                        [--concurrency 1,4,32] [--threads N] [--quick]

Two workloads, greedy, each request's budget min(reply tokens, --max-tokens):
  sharegpt  ShareGPT first turns as they are (answers rarely copy their prompt);
  grounded  input-grounded rewriting built from the same dataset: "Repeat the following text,
            fixing any spelling mistakes" over a ShareGPT reply, whose answer copies its input.
At each concurrency the requests run in batches of `concurrency`, each batch on an engine with
drafts off and then on one with k = --tokens, so drift on the machine hits both alike; outputs
must be equal token for token. Reports tokens/s, tokens per step, acceptance and the machine's
ISA. Writes bench/results/speculative.json.
"""

from __future__ import annotations

import time

from bench.harness import markdown_table
from bench.provenance import cpu_isa
from bench.sharegpt import load_requests
from bench.studies.common import base_parser, env_info, load, make_engine, warm_up, write_json
from bench.workloads import grounded_messages
from engine import SamplingParams


def grounded_requests(tokenizer, count: int, seed: int, max_tokens: int) -> list[tuple]:
    """(prompt ids, budget) of bench.workloads' rewriting requests."""
    return [(tokenizer.encode(tokenizer.apply_chat_template(m, tokenize=False,
                                                            add_generation_prompt=True),
                              add_special_tokens=False), n)
            for m, n in grounded_messages(tokenizer, count, seed, max_tokens)]


def compare(loaded, threads: int, jobs: list[tuple], k: int, concurrency: int) -> dict:
    """`jobs` in batches of `concurrency`, each batch on an engine without drafts, then on one
    with `k` draft tokens, so that drift on the machine hits both alike."""
    engines = {}
    for name, tokens in (("off", 0), ("on", k)):
        engines[name] = make_engine(loaded, threads, background=True,
                                    num_speculative_tokens=tokens,
                                    speculative_max_rows=max(concurrency, 1),
                                    prompt_cache_bytes=0)[0]
    out = {name: {"outputs": [], "seconds": 0.0} for name in engines}
    try:
        for at in range(0, len(jobs), concurrency):
            batch = jobs[at : at + concurrency]
            for name, eng in engines.items():
                t0 = time.perf_counter()
                handles = [eng.submit(ids, SamplingParams(strategy="greedy", max_new_tokens=n))
                           for ids, n in batch]
                out[name]["outputs"] += [[t for d in h.iter_sync() for t in d.token_ids]
                                         for h in handles]
                out[name]["seconds"] += time.perf_counter() - t0
        for name, eng in engines.items():
            stats = eng.stats()
            tokens = sum(map(len, out[name]["outputs"]))
            out[name].update(tokens=tokens, steps=stats.steps,
                             tokens_per_s=round(tokens / out[name]["seconds"], 2),
                             proposed=stats.spec_proposed_tokens,
                             accepted=stats.spec_accepted_tokens)
    finally:
        for eng in engines.values():
            eng.stop(drain=False)
    return out


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4, help="draft tokens when on")
    ap.add_argument("--concurrency", default="1,4,32")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.concurrency = 4, 24, "1,4"
    loaded = load(args.threads, args.device, args.dtype)
    tok = loaded.tokenizer
    workloads = {
        "sharegpt": [(r.prompt_ids, r.max_tokens) for r in
                     load_requests(tok, args.num_prompts, seed=args.seed,
                                   max_output=args.max_tokens)],
        "grounded": grounded_requests(tok, args.num_prompts, args.seed, args.max_tokens),
    }
    warm_up(loaded)
    result = {"env": {**env_info(loaded, args.threads), "isa": cpu_isa()}, "runs": []}
    rows = []
    for name, jobs in workloads.items():
        for concurrency in map(int, args.concurrency.split(",")):
            jobs_c = (jobs * (1 + concurrency // len(jobs)))[: max(len(jobs), concurrency)]
            both = compare(loaded, args.threads, jobs_c, args.tokens, concurrency)
            off, on = both["off"], both["on"]
            equal = on.pop("outputs") == off.pop("outputs")
            rate = on["accepted"] / on["proposed"] if on["proposed"] else 0.0
            result["runs"].append({"workload": name, "concurrency": concurrency, "off": off,
                                   "on": on, "outputs_equal": equal})
            rows.append([name, concurrency, off["tokens_per_s"], on["tokens_per_s"],
                         round(on["tokens_per_s"] / off["tokens_per_s"], 2),
                         round(off["tokens"] / max(off["steps"], 1), 2),
                         round(on["tokens"] / max(on["steps"], 1), 2), round(rate, 2), equal])
    print(f"ISA: {' '.join(cpu_isa()) or 'unknown'}; threads {args.threads}")
    print(markdown_table(["workload", "concurrency", "off tok/s", "on tok/s", "on/off",
                          "tokens/step off", "tokens/step on", "acceptance", "equal"], rows))
    write_json("speculative", result)


if __name__ == "__main__":
    main()
