"""Block products alone: the time of one pass over every linear layer of the embedded model
through its few-row kernel, at a few row counts (as decode steps and verified drafts call them),
for this checkout's build of the native kernels.

    python -m bench.studies.block_products [--quantize int4|int8|exact] [--rows 1,2,4,5,8]
        [--rounds 3]

The layers are grouped by block kind (the Q8_0 head apart from the rest under int4); `exact` is
the default path's kernel (the GGUF's own blocks, multiplied in fp32). One process
loads one build of the kernels, so two commits are compared by running this in each checkout in
turn, several rounds each (this host's timings move between runs)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from bench.provenance import cpu_isa
from bench.studies.common import base_parser, load, write_json
from bench.studies.quality import variant
from engine.model import lowbit


def main() -> None:
    ap = base_parser(__doc__.splitlines()[0])
    ap.add_argument("--quantize", default="int4", choices=["int4", "int8", "exact"])
    ap.add_argument("--rows", default="1,2,4,5,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=21, help="passes per row count (min, median)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.passes, args.rows = 1, 3, "1,5"
    loaded = load(args.threads, args.device, "fp32")
    model = variant(loaded.model.eval(), "exact" if args.quantize == "exact"
                    else f"{args.quantize}-q8")
    groups: dict[str, list[lowbit.BlockLinear]] = defaultdict(list)
    for m in model.modules():
        if isinstance(m, lowbit.BlockLinear):
            groups[m.kind].append(m)
    rows = [int(n) for n in args.rows.split(",")]
    results: dict[str, dict[str, list]] = {k: {str(n): [] for n in rows} for k in groups}
    with torch.no_grad():
        for rnd in range(args.rounds):
            for kind, layers in groups.items():
                line = []
                for n in rows:
                    xs = {m.in_features: torch.randn(n, m.in_features) for m in layers}
                    times = []
                    for _ in range(args.passes):
                        t0 = time.perf_counter()
                        for m in layers:
                            m.kernel_product(xs[m.in_features])
                        times.append(time.perf_counter() - t0)
                    best, median = min(times) * 1e3, statistics.median(times) * 1e3
                    results[kind][str(n)].append([round(best, 3), round(median, 3)])
                    line.append(f"{n}: {best:.2f}/{median:.2f}")
                print(f"round {rnd} {kind} ({len(layers)} layers) ms min/median  "
                      + "  ".join(line), flush=True)
    out = write_json("block_products", {
        "isa": cpu_isa(), "threads": args.threads, "quantize": args.quantize,
        "layers": {k: len(v) for k, v in groups.items()}, "ms_min_median": results}, args.out)
    print("wrote", out)


if __name__ == "__main__":
    main()
