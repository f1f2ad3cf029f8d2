"""Output tokens/s: the engine (rolling batch) vs transformers `generate`, in the same process.

    python -m bench.studies.throughput [--num-prompts 64] [--max-tokens 128]
                                       [--baseline-a-prompts 16] [--threads N] [--quick]

Methods, all greedy on the same ShareGPT prompts, each request generating exactly its budget
(min(reply tokens, --max-tokens); EOS blocked until then, on every side) so the work is equal:
  (E) the engine: every request submitted at once to the background engine thread;
  (a) `model.generate` one request at a time, on the first --baseline-a-prompts requests only
      (it is slow): its tokens/s is a rate, comparable although measured on a subset;
  (b) `model.generate` on static left-padded batches of 8 in arrival order: a batch runs until its
      longest budget is reached; tokens past a request's own budget are wasted and not counted.
Writes bench/results/throughput.json.
"""

from __future__ import annotations

from bench.harness import markdown_table
from bench.provenance import jsonable
from bench.sharegpt import load_requests
from bench.studies.common import (
    base_parser,
    env_info,
    fixed_length,
    hf_generate,
    load,
    make_engine,
    mib,
    run_engine,
    timed,
    warm_up,
    write_json,
)
from engine import EngineConfig

STATIC_BATCH = 8


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128, help="cap on each request's budget")
    ap.add_argument("--baseline-a-prompts", type=int, default=16,
                    help="requests for generate-one-at-a-time (a subset: it is slow)")
    ap.add_argument("--max-batch", type=int, default=EngineConfig.max_rolling_batch_size,
                    help="engine max_rolling_batch_size")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.baseline_a_prompts = 8, 16, 4
    n_a = min(args.baseline_a_prompts, args.num_prompts)

    loaded = load(args.threads, args.device, args.dtype)
    reqs = load_requests(loaded.tokenizer, args.num_prompts, seed=args.seed,
                         max_output=args.max_tokens)
    prompts = [r.prompt_ids for r in reqs]
    budgets = [r.max_tokens for r in reqs]
    print(f"{len(reqs)} ShareGPT requests: {sum(map(len, prompts)):,} prompt tokens, "
          f"{sum(budgets):,} output tokens (budgets {min(budgets)}-{max(budgets)}); "
          f"threads={args.threads}")
    warm_up(loaded)

    # (E) the engine, every request at once.
    eng, rec = make_engine(loaded, args.threads, max_rolling_batch_size=args.max_batch)
    run_engine(eng, [(prompts[0], fixed_length(2))])  # warm the engine path too
    rec.steps.clear()
    engine_out, engine_s = run_engine(eng, [(p, fixed_length(b)) for p, b in zip(prompts, budgets)])
    eng.stop()
    assert [len(o) for o in engine_out] == budgets, "the engine did not generate every budget"
    print(f"(E) engine: {engine_s:.1f}s")

    # (a) generate, one request at a time, on a subset.
    a_out = []
    with timed() as a_t:
        for p, b in zip(prompts[:n_a], budgets[:n_a]):
            a_out.append(hf_generate(loaded, [p], b)[0])
    print(f"(a) generate one at a time ({n_a} requests): {a_t.seconds:.1f}s")

    # (b) generate on static batches of 8, in arrival order.
    b_out, computed = [], 0
    with timed() as b_t:
        for i in range(0, len(prompts), STATIC_BATCH):
            bp, bb = prompts[i : i + STATIC_BATCH], budgets[i : i + STATIC_BATCH]
            rows = hf_generate(loaded, bp, max(bb))
            computed += len(bp) * max(bb)
            b_out += [row[:n] for row, n in zip(rows, bb)]
    print(f"(b) generate, static batches of {STATIC_BATCH}: {b_t.seconds:.1f}s")

    e_tokens, a_tokens = sum(budgets), sum(budgets[:n_a])
    e_rate = e_tokens / engine_s
    methods = [
        ("E: engine (rolling batch)", len(reqs), e_tokens, engine_s),
        ("a: generate, one at a time", n_a, a_tokens, a_t.seconds),
        (f"b: generate, static batches of {STATIC_BATCH}", len(reqs), e_tokens, b_t.seconds),
    ]
    rows = [(name, n, tok, s, tok / s, (tok / s) / e_rate) for name, n, tok, s in methods]
    print()
    print(markdown_table(["method", "requests", "output tokens", "seconds", "tokens/s",
                          "vs engine"], rows))
    print(f"\n(a) ran on the first {n_a} of {len(reqs)} requests: tokens/s is a rate, comparable "
          f"across methods. (b) computed {computed:,} tokens for the {e_tokens:,} counted "
          f"(each batch runs to its longest budget).")

    st = rec.summary()
    print(f"\nEngine steps: {st['steps']} ({st['decode_steps']} with a batch), "
          f"max_rolling_batch_size={args.max_batch}, mean running {st['mean_running']:.1f}, "
          f"mean sub-batches/step {st['mean_sub_batches']:.2f} (max {st['max_sub_batches']}), "
          f"mean sparsity {st['mean_sparsity']:.3f}, peak KV {mib(st['peak_kv_bytes']):.1f} MiB, "
          f"steps {st['step_seconds']:.1f}s ({st['prefill_step_seconds']:.1f}s in steps with "
          f"prompt chunks); "
          f"decode step ms: pure {1e3 * (st['pure_decode_step_seconds']['mean'] or 0):.0f} mean "
          f"over {st['pure_decode_steps']} steps, with chunks or a regroup "
          f"{1e3 * (st['regroup_decode_step_seconds']['mean'] or 0):.0f} mean over "
          f"{st['regroup_decode_steps']} steps")

    same_a = sum(e == a for e, a in zip(engine_out, a_out))
    same_b = sum(e == b for e, b in zip(engine_out, b_out))
    print(f"Greedy outputs equal to the engine's: (a) {same_a}/{n_a}, (b) {same_b}/{len(reqs)} "
          f"(padded fp32 batches may flip near-tied tokens)")

    path = write_json("throughput", {
        "args": jsonable(args),
        "env": env_info(loaded, args.threads),
        "requests": {"count": len(reqs), "prompt_tokens": [len(p) for p in prompts],
                     "budgets": budgets},
        "methods": [dict(zip(["method", "requests", "output_tokens", "seconds", "tokens_per_s",
                              "ratio_vs_engine"], r)) for r in rows],
        "static_batch": {"size": STATIC_BATCH, "computed_tokens": computed},
        "engine_steps": st,
        "outputs_equal_to_engine": {"a": [same_a, n_a], "b": [same_b, len(reqs)]},
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
