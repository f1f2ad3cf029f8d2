"""Max-sparsity splitting: KV memory, padding and step time, max_splits=1 vs the defaults.

    python -m bench.studies.splitting [--prompts 32] [--min-len 8] [--max-len 1000]
                                      [--new-tokens 32] [--configs all|main] [--threads N] [--quick]

One batch whose prompt lengths span two orders of magnitude (log-spaced from --min-len to
--max-len tokens, cut from ShareGPT user text, submitted at once in a shuffled order), greedy,
exactly --new-tokens each, run by the background engine under each configuration:
  no split (max_splits=1) · defaults (max_sparsity=0.33, max_splits=3) · and with --configs all
  max_sparsity=0.05 and 1.0 (max_splits=3).
Per configuration, from the engine's StepStats: peak KV bytes, mean padded tokens, mean sub-batches
per step, decode-step time (all steps with a batch, and pure decode steps), total output tokens/s.
Greedy outputs must not depend on the partition; the table says whether they do.
Writes bench/results/splitting.json.
"""

from __future__ import annotations

import random

from bench.harness import markdown_table
from bench.provenance import jsonable
from bench.sharegpt import text_token_ids
from bench.studies.common import (
    base_parser,
    env_info,
    fixed_length,
    load,
    make_engine,
    mib,
    run_engine,
    warm_up,
    write_json,
)

CONFIGS = {  # label: (max_sparsity, max_splits, fuse_sub_batches)
    "no split (max_splits=1)": (0.33, 1, False),
    "defaults (0.33, 3)": (0.33, 3, False),
    "0.33, 3, fused forward": (0.33, 3, True),
    "max_sparsity=0.05, 3": (0.05, 3, False),
    "max_sparsity=1.0, 3": (1.0, 3, False),
}
MAIN = list(CONFIGS)[:3]


def log_spaced(count: int, lo: int, hi: int) -> list[int]:
    if count == 1:
        return [hi]
    return [round(lo * (hi / lo) ** (i / (count - 1))) for i in range(count)]


def kv_bytes_per_token(loaded) -> int:
    """Keys and values of one token over all layers, in the model's dtype."""
    cfg = loaded.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * loaded.dtype.itemsize


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--configs", choices=["all", "main"], default="all",
                    help="main: max_splits=1 and the defaults only")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.configs = 8, 16, "main"

    loaded = load(args.threads, args.device, args.dtype)
    lengths = log_spaced(args.prompts, args.min_len, args.max_len)
    random.Random(args.seed).shuffle(lengths)  # arrival order mixes short and long
    text = text_token_ids(loaded.tokenizer, sum(lengths), seed=args.seed)
    prompts, at = [], 0
    for n in lengths:
        prompts.append(text[at : at + n])
        at += n
    jobs = [(p, fixed_length(args.new_tokens)) for p in prompts]
    out_tokens = args.prompts * args.new_tokens
    final_real = sum(lengths) + args.prompts * (args.new_tokens - 1)
    per_token = kv_bytes_per_token(loaded)
    print(f"{args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens "
          f"({sum(lengths):,} in all), {args.new_tokens} new tokens each; threads={args.threads}")
    warm_up(loaded)

    labels = list(CONFIGS) if args.configs == "all" else MAIN
    results, reference = {}, None
    for label in labels:
        max_sparsity, max_splits, fuse = CONFIGS[label]
        eng, rec = make_engine(loaded, args.threads, max_rolling_batch_size=max(32, args.prompts),
                               max_sparsity=max_sparsity, max_splits=max_splits,
                               fuse_sub_batches=fuse)
        run_engine(eng, [(prompts[0][:8], fixed_length(2))])  # warm the engine path
        rec.steps.clear()
        outputs, seconds = run_engine(eng, jobs)
        eng.stop()
        reference = reference or outputs
        st = rec.summary()
        results[label] = {"max_sparsity": max_sparsity, "max_splits": max_splits, "fused": fuse,
                          "seconds": seconds, "tokens_per_s": out_tokens / seconds,
                          "same_outputs_as_first": outputs == reference, "steps": st}
        print(f"{label}: {seconds:.1f}s")

    rows = []
    for label, r in results.items():
        st = r["steps"]
        rows.append((label, mib(st["peak_kv_bytes"]), st["mean_padded_tokens"],
                     st["mean_sparsity"], st["mean_sub_batches"],
                     st["decode_step_seconds"]["mean"] * 1e3,
                     (st["pure_decode_step_seconds"]["median"] or 0.0) * 1e3,
                     st["prefill_step_seconds"], r["seconds"], r["tokens_per_s"],
                     "yes" if r["same_outputs_as_first"] else "NO"))
    print()
    print(markdown_table(["config", "peak KV MiB", "mean padded tokens", "mean sparsity",
                          "sub-batches/step", "decode step ms (mean)",
                          "pure decode ms (median)", "steps with prompt chunks s", "total s",
                          "tokens/s", "same output"], rows))
    print(f"\nReal tokens' KV at the last step: {mib(final_real * per_token):.1f} MiB "
          f"({per_token:,} bytes/token); peak KV includes padding and each sub-batch's "
          f"preallocated growth columns. Decode-step means include steps that admit or regroup.")

    path = write_json("splitting", {
        "args": jsonable(args),
        "env": env_info(loaded, args.threads),
        "prompt_lengths_in_arrival_order": lengths,
        "output_tokens": out_tokens,
        "kv_bytes_per_token": per_token,
        "real_kv_bytes_at_end": final_real * per_token,
        "configs": results,
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
