"""PNG plots of the serving benchmark (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first


def _ecdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return [xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))]


def _ttfts(runs: Sequence[dict]) -> list[float]:
    return [r["ttft"] for run in runs for r in run["requests"]
            if r["error"] is None and r["ttft"] is not None]


def throughput(groups: dict[tuple[str, int], list[dict]], path: Path) -> Path:
    """Output tokens/s against concurrency, one line per server (mean over repeats, bars from the
    slowest to the fastest repeat)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = 0.0
    for server in dict.fromkeys(s for s, _ in groups):
        levels = sorted(c for s, c in groups if s == server)
        values = [[run["figures"]["output_tokens_per_s"] for run in groups[server, c]]
                  for c in levels]
        means = [sum(v) / len(v) for v in values]
        err = [[m - min(v) for m, v in zip(means, values)],
               [max(v) - m for m, v in zip(means, values)]]
        ax.errorbar(levels, means, yerr=err, marker="o", capsize=3, label=server)
        top = max(top, *(max(v) for v in values))
    ax.set_xscale("log", base=2)
    all_levels = sorted({c for _, c in groups})
    ax.set_xticks(all_levels, [str(c) for c in all_levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(0, top * 1.15 or 1.0)
    ax.set_title("Throughput vs concurrency (ShareGPT, greedy, streamed)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def ttft_distribution(groups: dict[tuple[str, int], list[dict]], path: Path) -> Path:
    """The TTFT distribution (ECDF) per server, one panel per concurrency."""
    levels = sorted({c for _, c in groups})
    fig, axes = plt.subplots(1, len(levels), figsize=(4 * len(levels), 3.8), squeeze=False,
                             sharey=True)
    for ax, conc in zip(axes[0], levels):
        for (server, c), runs in groups.items():
            values = _ttfts(runs) if c == conc else []
            if values:
                ax.step(*_ecdf(values), where="post", label=server)
        ax.set_xscale("log")
        ax.set_title(f"concurrency {conc}")
        ax.set_xlabel("time to first token (s)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize="small")
    fig.suptitle("Time to first token")
    return _save(fig, path)


def cache_ttft(groups: dict[str, list[dict]], path: Path) -> Path:
    """TTFT distribution with seqgate's prompt cache on and off."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, runs in groups.items():
        values = _ttfts(runs)
        if values:
            ax.step(*_ecdf(values), where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Shared system prompt: TTFT with the prompt cache on and off")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
