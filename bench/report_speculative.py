"""The speculative phase's section of docs/benchmarks.md (bench.serving): per workload and
concurrency, each server's output tokens/s, seqgate's acceptance and tokens per engine step, and
seqgate's ratio to the best llama.cpp (plain or with its n-gram speculation) from runs taken side
by side."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from bench.figures import geomean, mean_of, paired_ratios, pooled
from bench.harness import markdown_table


def _g(value, unit: float = 1.0) -> str:
    return "-" if value is None else f"{value * unit:.3g}"


def _engine(runs: Sequence[dict], key: str) -> float:
    return sum((r.get("engine") or {}).get(key) or 0 for r in runs)


def acceptance(runs: Sequence[dict]) -> float | None:
    """Draft tokens kept per draft token fed, over the runs (None without drafts)."""
    proposed = _engine(runs, "spec_proposed_tokens")
    return _engine(runs, "spec_accepted_tokens") / proposed if proposed else None


def tokens_per_step(runs: Sequence[dict]) -> float | None:
    """Generated tokens per engine step (prefill steps included), over the runs."""
    steps = _engine(runs, "steps")
    return _engine(runs, "generated_tokens") / steps if steps else None


def best_peer(groups: dict[str, list[dict]]) -> str | None:
    """The llama.cpp variant with the most output tokens/s at this cell."""
    peers = {s: mean_of(runs, "output_tokens_per_s") or 0.0 for s, runs in groups.items()
             if not s.startswith("seqgate")}
    return max(peers, key=peers.get) if peers else None


def speculative_section(runs: Sequence[dict], isa: str) -> list[str]:
    cells: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        cells[(run["workload"], run["concurrency"])][run["server"]].append(run)
    rows, ratio_rows = [], []
    for (workload, conc), groups in sorted(cells.items()):
        for server, group in groups.items():
            ours = server.startswith("seqgate")
            rows.append([workload, str(conc), server, str(len(group)),
                         _g(mean_of(group, "output_tokens_per_s")),
                         _g(pooled(group, "tpot", 50), 1e3), _g(pooled(group, "ttft", 50)),
                         _g(acceptance(group)) if ours else "-",
                         _g(tokens_per_step(group)) if ours else "-"])
        peer = best_peer(groups)
        for server in (s for s in groups if s.startswith("seqgate") and peer):
            r = paired_ratios(groups[server], groups[peer], "output_tokens_per_s")
            ratio_rows.append([workload, str(conc), server, peer, _g(geomean(r)),
                               ", ".join(_g(x) for x in r)])
    if not rows:
        return []
    return ["## Speculative decoding against llama.cpp", "",
            f"CPU ISA: {isa}. Greedy streamed chats; `seqgate` drafts by prompt lookup (its "
            "default), `seqgate-nospec` does not; `llama.cpp-lookup` runs llama.cpp's "
            "`ngram-simple` speculation. Acceptance: draft tokens kept per draft token fed; "
            "tokens/step: generated tokens per engine step (prefill steps included).", "",
            markdown_table(["workload", "concurrency", "server", "runs", "output tok/s",
                            "TPOT p50 ms", "TTFT p50 s", "acceptance", "tokens/step"], rows), "",
            "seqgate / the faster llama.cpp at each cell (geometric mean of per-repeat ratios; "
            "each ratio pairs runs taken next to each other):", "",
            markdown_table(["workload", "concurrency", "seqgate", "peer", "tok/s ratio",
                            "per repeat"], ratio_rows), ""]
