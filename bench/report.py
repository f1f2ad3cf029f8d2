"""The serving benchmark's report: raw results (JSON) → docs/benchmarks.md and PNG plots.

    python -m bench.report [bench/results/serving.json] [--doc docs/benchmarks.md]

Regenerates the report from a results file without rerunning anything. Repeats of a
(server, concurrency) pair are aggregated thus: throughput is the mean over runs, latency
percentiles are taken over all the runs' requests together, errors are summed and peak RSS is the
largest. seqgate/peer ratios are geometric means of per-repeat ratios, each pairing two runs
taken one after the other (A B A B), with the range of those ratios.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from bench import plots
from bench.figures import geomean, mean_of, paired_ratios, pooled, ratio
from bench.harness import DOCS_DIR, RESULTS_DIR, markdown_table
from bench.report_speculative import speculative_section

PEER_NOTES = """\
- llama.cpp's server (the `xllamacpp` wheel, `bench/llamacpp_server.py`) serves the GGUF that
  seqgate embeds and computes with its Q4_1 weights; seqgate de-quantises that file and computes
  in its own dtype, so the two run the same weights at different precisions (llama.cpp's
  arithmetic is cheaper per token, and its greedy texts differ from seqgate's). It gets one slot
  per concurrent request, each with 2,048 tokens of context, and 2 threads.
- `transformers serve` pins the model given as FORCE_MODEL: a request must name exactly that string
  (here the model directory) or no model. Its `GET /v1/models` answers 500 when there is no hub
  cache to scan, so readiness is polled on `/health`, which answers once the model is loaded.
- It sends a role-only first chunk at once, so time to first token counts from the first chunk with
  content. It ends a stream without `data: [DONE]`, and always puts `usage` in its last chunk; it
  ignores `stream_options` (logging that once), which seqgate needs to report usage in a stream.
- Without `--continuous-batching` it runs one `generate()` at a time on one thread: concurrent
  requests queue, so their time to first token grows with the queue.
- With `--continuous-batching` it builds the batching manager on the first request (about 10 s
  here; the warm-up requests absorb it), shares that request's sampling settings with every later
  one (all greedy here), and sizes its paged KV cache from the free memory: on the CPU its resident
  memory reaches several GiB whatever the load.
- Its `--dtype auto` runs the weights' dtype (fp32 here), while seqgate's `auto` picks bf16 on
  a CPU with bf16 in hardware (AMX or AVX512-BF16): the sweep compares the two defaults (the
  header says which dtypes ran). To compare at one precision add
  `BENCH_ARGS="--peer-arg=--dtype=bfloat16"` or `"--seqgate-arg=--dtype=fp32"`; the agreement
  phase runs seqgate in fp32 as well.
- OpenVINO GenAI (`openvino-genai`, `bench/openvino_peer.py`) has no HTTP server in Python: it
  runs **in-process**, its `ContinuousBatchingPipeline` (paged attention, dynamic split-fuse) fed
  token ids through `add_request`/`step` with the same prompts, chat template and budgets, so it
  pays no HTTP, JSON or detokenisation cost that the servers pay. Its weights are the same copy
  exported by `optimum-cli export openvino` as fp16 (`openvino`, against seqgate's exact
  default), int8 per channel (`openvino-int8`) and int4 in groups of 32 (`openvino-int4`);
  2 inference threads, 2 GB of KV blocks, its other scheduler settings its defaults.
- Both run with their default torch thread count (all cores); seqgate chooses its own
  (`option.num_threads`). The load generator runs on the same machine as the server.
"""


def _g(value, unit: float = 1.0) -> str:
    """Three significant digits (thousands separated); '-' for missing."""
    if value is None:
        return "-"
    v = value * unit
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.0f}"


def group(runs: Sequence[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        out[tuple(run[k] for k in keys)].append(run)
    return dict(out)


def _aggregate_row(runs: Sequence[dict]) -> list[str]:
    return [str(len(runs)), _g(mean_of(runs, "output_tokens_per_s")),
            _g(mean_of(runs, "requests_per_s")),
            _g(pooled(runs, "ttft", 50)), _g(pooled(runs, "ttft", 95)),
            _g(pooled(runs, "tpot", 50), 1e3), _g(pooled(runs, "tpot", 95), 1e3),
            _g(pooled(runs, "e2e", 50)), _g(pooled(runs, "e2e", 95)),
            str(sum(r["figures"]["errors"] for r in runs)),
            f'{_mib(max(r["memory"]["run_peak_rss"] for r in runs))} / '
            f'{_mib(max(r["memory"]["peak_rss"] for r in runs))}']


LATENCY_HEADERS = ["runs", "output tok/s", "req/s", "TTFT p50 s", "TTFT p95 s", "TPOT p50 ms",
                   "TPOT p95 ms", "E2E p50 s", "E2E p95 s", "errors", "RSS MiB run / life peak"]


def _ratio_cell(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    gm = geomean(ratios)
    if len(ratios) == 1:
        return f"{_g(gm)}×"
    return f"{_g(gm)}× ({_g(min(ratios))}–{_g(max(ratios))})"


def sweep_section(runs: Sequence[dict], plot_dir: Path, doc_dir: Path) -> tuple[list[str], dict]:
    groups = group(runs, "server", "concurrency")
    rows = [[server, str(conc), str(runs_[0]["figures"]["requests"]), *_aggregate_row(runs_)]
            for (server, conc), runs_ in sorted(groups.items(), key=lambda kv: (kv[0][1],))]
    lines = ["## Sweep: ShareGPT chats at rising concurrency", "",
             markdown_table(["server", "concurrency", "requests", *LATENCY_HEADERS], rows), ""]
    ratios: dict = {}
    servers = list(dict.fromkeys(s for s, _ in groups))
    ours_labels = [s for s in servers if s.startswith("seqgate")]
    peers = [s for s in servers if not s.startswith("seqgate")]
    ratio_rows = []
    for ours_label in ours_labels:  # seqgate, and variants such as seqgate-int4
        for peer in peers:
            for conc in sorted({c for _, c in groups}):
                ours, theirs = groups.get((ours_label, conc)), groups.get((peer, conc))
                if not ours or not theirs:
                    continue
                tok = paired_ratios(ours, theirs, "output_tokens_per_s")
                ttft = paired_ratios(ours, theirs, "ttft_p50")
                key = (peer, conc) if ours_label == "seqgate" else (peer, conc, ours_label)
                ratios[key] = {"tokens_per_s": geomean(tok), "ttft_p50": geomean(ttft)}
                ratio_rows.append([ours_label, peer, str(conc), _ratio_cell(tok),
                                   _ratio_cell(ttft),
                                   _ratio_cell(paired_ratios(ours, theirs, "tpot_p50"))])
    if ratio_rows:
        lines += ["seqgate / peer, from runs taken side by side (geometric mean of the per-repeat "
                  "ratios; range in brackets). Above 1 is better for tokens/s, below 1 for "
                  "latency.", "",
                  markdown_table(["seqgate", "peer", "concurrency", "output tok/s", "TTFT p50",
                                  "TPOT p50"], ratio_rows), ""]
    if groups:
        tp = plots.throughput(groups, plot_dir / "throughput.png")
        tt = plots.ttft_distribution(groups, plot_dir / "ttft.png")
        lines += [f"![throughput vs concurrency]({tp.relative_to(doc_dir)})", "",
                  f"![time to first token]({tt.relative_to(doc_dir)})", ""]
    return lines, ratios


def cache_section(runs: Sequence[dict], meta: dict, plot_dir: Path,
                  doc_dir: Path) -> tuple[list[str], float | None]:
    groups = {k[0]: v for k, v in group(runs, "server").items()}
    rows = []
    for label, runs_ in groups.items():
        hits = sum((r["engine"] or {}).get("prompt_cache_hits", 0) for r in runs_)
        cached = sum((r["engine"] or {}).get("prompt_cache_cached_tokens", 0) for r in runs_)
        rows.append([label, *_aggregate_row(runs_)[:5], f"{hits:.0f}", f"{cached:,.0f}"])
    on, off = groups.get("seqgate cache on"), groups.get("seqgate cache off")
    speedup = ratio(pooled(off, "ttft", 50), pooled(on, "ttft", 50)) if on and off else None
    conc = runs[0]["concurrency"] if runs else "-"
    lines = ["## Prompt cache: one shared system prompt", "",
             f"Every request starts with the same {meta.get('system_prompt_tokens', '~400')}"
             f"-token system prompt, at concurrency {conc}; seqgate with its prompt cache on "
             "(default) and off (`--prompt-cache-bytes 0`), interleaved.", "",
             markdown_table(["config", *LATENCY_HEADERS[:5], "cache hits", "cached tokens"],
                            rows), "",
             f"TTFT p50 without the cache / with it: **{_g(speedup)}×**.", ""]
    if groups:
        p = plots.cache_ttft(groups, plot_dir / "prompt_cache_ttft.png")
        lines += [f"![prompt cache TTFT]({p.relative_to(doc_dir)})", ""]
    return lines, speedup


def splitting_section(runs: Sequence[dict], meta: dict) -> tuple[list[str], dict]:
    groups = {k[0]: v for k, v in group(runs, "config").items()}
    base = groups.get("max_splits=1")
    base_tps = mean_of(base, "output_tokens_per_s") if base else None
    rows, summary = [], {}
    for label, runs_ in groups.items():
        tps = mean_of(runs_, "output_tokens_per_s")
        sub = [r["engine"]["sub_batches_per_step"] for r in runs_ if r["engine"]]
        sub_mean = ratio(sum(s["sum"] for s in sub), sum(s["count"] for s in sub))
        sub_max = max((s["max_le"] or 0 for s in sub), default=None)
        sp = [r["engine"]["sparsity_per_step"] for r in runs_ if r["engine"]]
        sp_mean = ratio(sum(s["sum"] for s in sp), sum(s["count"] for s in sp))
        growth = max(r["memory"]["run_growth"] for r in runs_)
        peak = max(r["memory"]["run_peak_rss"] for r in runs_)
        kv = [_peak_kv(r) for r in runs_]
        peak_kv = max(kv) if kv and None not in kv else None
        summary[label] = {"tokens_per_s": tps, "run_growth": growth, "run_peak_rss": peak,
                          "peak_kv_bytes": peak_kv}
        rows.append([label, str(len(runs_)), _g(tps), _g(ratio(tps, base_tps)), _mib(peak_kv),
                     _mib(peak), _mib(growth), _g(sub_mean), _g(sub_max), _g(sp_mean),
                     str(sum(r["figures"]["errors"] for r in runs_))])
    lengths = meta.get("splitting_prompt_lengths") or []
    conc = runs[0]["concurrency"] if runs else "-"
    lines = ["## Splitting: prompts over two orders of magnitude", "",
             f"{len(lengths)} completions over token-id prompts of {min(lengths, default=0)}–"
             f"{max(lengths, default=0)} tokens (log-spaced, shuffled), each generating exactly "
             f"the same number of tokens, at concurrency {conc}. Peak KV is the most bytes the "
             "rolling batch's KV slabs held after any step (seqgate_kv_cache_peak_bytes, "
             "padding included; on the CPU, columns reserved for tokens to come count once "
             "written; a fresh server per run). RSS is the "
             "server's resident memory: its largest value sampled during the run, and its "
             "growth over the idle server's (KV, activations and allocator slack). "
             "Sub-batches and sparsity per "
             "decode step come from seqgate's /metrics histograms (max: the histogram bucket "
             "that holds every step).", "",
             markdown_table(["config", "runs", "output tok/s", "vs max_splits=1",
                             "peak KV MiB", "run peak RSS MiB", "RSS growth MiB",
                             "sub-batches/step", "max sub-batches", "mean sparsity", "errors"],
                            rows), ""]
    return lines, summary


def _peak_kv(run: dict) -> float | None:
    """The engine's peak KV bytes over the run (the server starts fresh for every run)."""
    gauges = (run.get("engine") or {}).get("kv_gauges") or {}
    return gauges.get("seqgate_kv_cache_peak_bytes")


def agreement_section(section: dict) -> list[str]:
    comparisons = section.get("comparisons") or {}
    if not comparisons:
        return []
    dtypes = section.get("dtypes") or {}
    lines = ["## Greedy agreement", "",
             "Non-streamed greedy chats, same prompts and max_tokens on both sides; texts "
             "compared exactly. seqgate runs once per dtype; the peers run the weights' dtype.",
             ""]
    for pair, c in comparisons.items():
        ours, _, peer = pair.partition(" vs ")
        lines.append(f"- {ours} ({dtypes.get(ours, '?')}) vs {peer} ({dtypes.get(peer, '?')}): "
                     f"**{c['matches']}/{c['prompts']}** identical.")
    lines.append("")
    diffs = [[peer, str(r["index"]), str(r.get("first_diff_char", "-")),
              str(r.get("first_diff_token", "-")), f"{r['ours_tokens']}/{r['theirs_tokens']}",
              _tie(r), _cell(r.get("ours_context") or r.get("error", "")),
              _cell(r.get("theirs_context", ""))]
             for peer, c in comparisons.items() for r in c["rows"] if not r["match"]]
    if diffs:
        lines += ["Differences: the first differing character and token, seqgate's chosen token "
                  "there against its runner-up with their logprob gap (a gap of a few hundredths "
                  "is a near tie that rounding differences can tip), and the text around it.", "",
                  markdown_table(["pair", "prompt", "char", "token", "tokens (ours/theirs)",
                                  "seqgate's choice / runner-up (gap)", "seqgate", "peer"],
                                 diffs), ""]
    return lines


def _tie(row: dict) -> str:
    if row.get("ours_margin") is None:
        return "-"
    return (f"{_cell(row['ours_token'])} / {_cell(row['ours_runner_up'])} "
            f"({row['ours_margin']:.3f})")


def _cell(text: str) -> str:
    return "`" + text.replace("\n", "⏎").replace("|", "\\|").replace("`", "'") + "`"


def targets_section(ratios: dict, cache_speedup: float | None, split: dict) -> list[str]:
    rows = []

    def add(name: str, value: float | None, goal: str, ok: bool | None) -> None:
        rows.append([name, _g(value), goal, "-" if ok is None else ("yes" if ok else "**no**")])

    for peer in ("tf-serve-cb", "tf-serve"):
        r32, r1 = ratios.get((peer, 32)), ratios.get((peer, 1))
        if r32:
            t, f = r32["tokens_per_s"], r32["ttft_p50"]
            add(f"c=32 output tok/s vs {peer}", t, "≥ 2.5×", None if t is None else t >= 2.5)
            add(f"c=32 TTFT p50 vs {peer}", f, "≤ 0.33×", None if f is None else f <= 1 / 3)
        if r1:
            t = r1["tokens_per_s"]
            add(f"c=1 output tok/s vs {peer}", t, "≥ 1.3×", None if t is None else t >= 1.3)
    r1, r32 = ratios.get(("llama.cpp", 1)), ratios.get(("llama.cpp", 32))
    if r1 and r1["tokens_per_s"] is not None:  # issue 12's targets against the CPU user's peer
        add("c=1 output tok/s vs llama.cpp", r1["tokens_per_s"], "≥ 0.7×",
            r1["tokens_per_s"] >= 0.7)
    q1 = ratios.get(("llama.cpp", 1, "seqgate-int4"))
    if q1 and q1["tokens_per_s"] is not None:  # at the peer's own precision class
        add("c=1 output tok/s, seqgate --quantize int4 vs llama.cpp", q1["tokens_per_s"],
            "≥ 0.7×", q1["tokens_per_s"] >= 0.7)
    if r32:
        t, f = r32["tokens_per_s"], r32["ttft_p50"]
        add("c=32 output tok/s vs llama.cpp", t, "≥ 3.5×", None if t is None else t >= 3.5)
        add("c=32 TTFT p50 vs llama.cpp", f, "≤ 1×", None if f is None else f <= 1)
    for ours, peer, goal in (("seqgate", "openvino", 1.5), ("seqgate-w8a8", "openvino-int8", 1.5),
                             ("seqgate-w8a8", "llama.cpp", 3.0)):
        r = ratios.get((peer, 32) if ours == "seqgate" else (peer, 32, ours))
        if r and r["tokens_per_s"] is not None:  # issue 29's targets at the peer's class
            add(f"c=32 output tok/s, {ours} vs {peer}", r["tokens_per_s"], f"≥ {goal}×",
                r["tokens_per_s"] >= goal)
    both = [ratios.get((p, 1)) for p in ("llama.cpp", "openvino")]
    if all(r and r["tokens_per_s"] is not None for r in both):
        worst = min(r["tokens_per_s"] for r in both)
        add("c=1 output tok/s vs the faster of llama.cpp and openvino", worst, "≥ 0.5×",
            worst >= 0.5)
    if cache_speedup is not None:
        add("prompt cache: TTFT p50 off / on", cache_speedup, "≥ 3×", cache_speedup >= 3)
    base = split.get("max_splits=1")
    dflt = split.get("max_splits=3, max_sparsity=0.33 (defaults)")
    if base and dflt:
        # Results from before the KV gauge existed have no peak KV: RSS growth stands in.
        has_kv = base.get("peak_kv_bytes") and dflt.get("peak_kv_bytes") is not None
        key, what = ("peak_kv_bytes", "peak KV") if has_kv else ("run_growth", "RSS growth")
        mem = ratio(dflt[key], base[key])
        add(f"splitting: defaults' {what} / max_splits=1", mem, "< 1×",
            None if mem is None else mem < 1)
        tps = ratio(dflt["tokens_per_s"], base["tokens_per_s"])
        add("splitting: defaults' tok/s / max_splits=1", tps, "≥ 0.85×",
            None if tps is None else tps >= 0.85)
    if not rows:
        return []
    return ["## Targets (issue 4)", "",
            markdown_table(["target", "measured", "goal", "met"], rows), ""]


def render(data: dict, doc: Path) -> str:
    meta, m, v = data["meta"], data["meta"]["machine"], data["meta"]["versions"]
    plot_dir = doc.parent / doc.stem
    sweep_lines, ratios = sweep_section(data["sweep"], plot_dir, doc.parent)
    cache_lines, speedup = cache_section(data["cache"], meta, plot_dir, doc.parent) \
        if data["cache"] else ([], None)
    split_lines, split = splitting_section(data["splitting"], meta) \
        if data["splitting"] else ([], {})
    sha = (v.get("seqgate_git_sha") or "?")[:12] + (" (uncommitted changes)"
                                                    if v.get("seqgate_git_dirty") else "")
    phases = ", ".join(f"{k} {s / 60:.1f} min" for k, s in meta["phase_seconds"].items())
    head = [
        "# Serving benchmarks", "",
        "Generated by `make bench` (`bench/serving.py`, report by `bench/report.py`); rerun it "
        "rather than editing this file.", "",
        f"- Command: `{meta['command']}`",
        f"- Run: {meta['started']} → {meta.get('finished', '?')} ({phases or 'no phase done'})",
        f"- Machine: {m['cpu']}, vector ISA {' '.join(m.get('isa') or []) or 'unknown'}, "
        f"{m['cores_available']} cores available "
        f"({m['logical_cpus']} logical CPUs), {m['memory_gib']} GiB RAM; 1-minute load "
        f"average at start {m['load_avg_1m_at_start']}" + _cap_line(meta.get("isa_cap")),
        f"- Versions: seqgate {v.get('seqgate')} at {sha}, torch {v['torch']}, transformers "
        f"{v['transformers']}, Python {v['python']}",
        f"- Model: SmolLM2-135M-Instruct on the CPU, the same local copy "
        f"(`{meta['model_dir']}`, {meta.get('weights_dtype', '?')} weights) for every server; "
        f"dtype: seqgate {_seqgate_dtype(data)} (its default), transformers serve "
        f"{_peer_dtype(meta)}",
        "- Workload: ShareGPT V3 first human turns (prompts 4–1024 tokens with the chat "
        "template), max_tokens = the first reply's token count capped at "
        f"{meta['args']['max_tokens']}, greedy, streamed chat completions, closed loop, seed "
        f"{meta['args']['seed']}. TTFT counts to the first content chunk; TPOT is (end − first "
        "token) / (tokens − 1) per request; throughput is over the run's wall time.", "",
    ]
    head += _contention(data)
    head += _kernels(data)
    skipped = meta["args"].get("skip") or []
    if skipped:
        head += [f"- Sweep cells left out with --skip: {', '.join(skipped)}.", ""]
    if meta["args"].get("quick"):
        head += ["**A --quick smoke run: too few requests for the numbers to mean anything.**", ""]
    failures = [f"- {f['phase']}: {f['server']}"
                f"{' at concurrency ' + str(f['concurrency']) if 'concurrency' in f else ''}: "
                f"{_first_last(f['error'])}" for f in data.get("failures", [])]
    if failures:
        failures = ["## Runs that failed", "", *failures, ""]
    isa = " ".join(m.get("isa") or []) or "unknown"
    if meta.get("isa_cap"):
        isa += f", capped to {meta['isa_cap']['isa']}"
    spec_lines = speculative_section(data.get("speculative") or [], isa)
    return "\n".join(head + targets_section(ratios, speedup, split) + sweep_lines + cache_lines
                     + split_lines + spec_lines + agreement_section(data["agreement"]) + failures
                     + scheduler_section(doc) + ["## Notes on the peer", "", PEER_NOTES])


# Written beside the plots by bench.stall, bench.multiturn and bench.structured; scheduler.md is
# kept by hand (before/after comparisons across commits, which one run of `make bench` cannot
# make); grammar.md by bench.studies.grammar_libs (the grammar libraries compared, run by hand);
# speed.md by hand (profiles and the quantised rows against llama.cpp).
SCENARIOS = ("stall.md", "multiturn.md", "scheduler.md", "structured.md", "grammar.md",
             "routing.md", "speed.md")


def scheduler_section(doc: Path) -> list[str]:
    """The scheduler scenarios' reports (`make bench` runs them before this report)."""
    parts = [(doc.parent / "benchmarks" / name) for name in SCENARIOS]
    parts = [p.read_text().strip() for p in parts if p.exists()]
    return ["## Scheduler and structured-output scenarios", "", *parts, ""] if parts else []


def _first_last(text: str) -> str:
    """An error's first line and, for a multi-line one (a server log's tail), its last."""
    lines = text.strip().splitlines() or [""]
    return lines[0] + (f" … `{lines[-1].strip()}`" if len(lines) > 1 else "")


def _cap_line(cap: dict | None) -> str:
    """The machine line's note of a capped ISA (bench/isa_cap.py), '' where none was."""
    if not cap:
        return ""
    env = ", ".join(f"`{k}={v}`" for k, v in cap["env"].items())
    return (f"; **capped to {cap['isa']}** for seqgate and OpenVINO GenAI ({env}), which "
            "approximates such a machine on this CPU; llama.cpp's server is not capped, and "
            "the speed probe runs under the cap")


def _seqgate_dtype(data: dict) -> str:
    for key in ("sweep", "cache", "splitting", "speculative"):
        for run in data.get(key) or []:
            if run.get("server_info") and run.get("server", "seqgate").startswith("seqgate"):
                return run["server_info"].get("dtype") or "?"
    return (data["agreement"].get("dtypes") or {}).get("seqgate", "?")


def _peer_dtype(meta: dict) -> str:
    """The peer's dtype: `auto` takes the weights' unless --peer-arg set --dtype."""
    args = meta["args"].get("peer_arg") or []
    for i, a in enumerate(args):
        if a.startswith("--dtype="):
            return a.split("=", 1)[1]
        if a == "--dtype" and i + 1 < len(args):
            return args[i + 1]
    return f"{meta.get('weights_dtype', '?')} (auto: the weights' dtype)"


def _contention(data: dict) -> list[str]:
    """A line on how busy the machine was with other work during the runs."""
    runs = [r for key in ("sweep", "cache", "splitting") for r in data[key] if r.get("cpu")]
    if not runs:
        return []
    worst = max(runs, key=lambda r: r["cpu"]["other_cores"])
    mean = sum(r["cpu"]["other_cores"] for r in runs) / len(runs)
    line = (f"- Other processes' CPU use during the runs: {mean:.2f} cores on average, at most "
            f"{worst['cpu']['other_cores']:.2f} ({worst['server']}, concurrency "
            f"{worst['concurrency']}).")
    if worst["cpu"]["other_cores"] > 0.25:
        line += (" **The machine was not quiet: rerun on an idle machine before trusting "
                 "absolute numbers or ratios.**")
    speed = _speed(runs)
    return [line, *([speed] if speed else []), ""]


def _kernels_of(info: dict | None) -> dict | None:
    """The kernels a seqgate server's `/version` names; None where it names none (a peer, or
    results from before `/version` listed them)."""
    return ((info or {}).get("engine") or {}).get("kernels")


def without_native_kernels(info: dict | None) -> bool:
    """Whether a seqgate server's `/version` says it ran on the CPU with no native kernel."""
    kernels = _kernels_of(info)
    return (kernels is not None and info.get("device") == "cpu"
            and not kernels.get("decode_attention_layers")
            and (kernels.get("linear") or {}).get("mode", "off") == "off"
            and not kernels.get("w8a8"))


def _kernels(data: dict) -> list[str]:
    """A line on the native kernels each seqgate server ran with (its `/version`), loud where
    one ran on the CPU without any: a library that failed to build falls back to PyTorch
    silently but for a log line, and its figures then measure that fallback."""
    seen: dict[str, dict] = {}  # server -> its `/version`
    for key in ("sweep", "cache", "splitting", "speculative"):
        for run in data.get(key) or []:
            if run.get("server", "").startswith("seqgate") and _kernels_of(run.get("server_info")):
                seen.setdefault(run["server"], run["server_info"])
    if not seen:
        return []
    parts, bare = [], []
    for server, info in seen.items():
        k = _kernels_of(info)
        linear = k.get("linear") or {}
        native = k.get("native_layers") or {}
        parts.append(f"{server}: decode attention in {k.get('decode_attention_layers', 0)} "
                     f"layers, linear blocks {linear.get('mode', 'off')} up to "
                     f"{linear.get('max_rows', 0)} rows, native layers up to "
                     f"{native.get('max_rows', 0)} rows")
        if without_native_kernels(info):
            bare.append(server)
    line = "- Native kernels (`/version`): " + "; ".join(parts) + "."
    if bare:
        line += (f" **{', '.join(bare)} ran without any native kernel** (the library did not "
                 "build, or `--decode-attention sdpa --linear-kernel torch`): its figures "
                 "measure PyTorch's fallback.")
    return [line, ""]


def _speed(runs: list[dict]) -> str | None:
    """A line on the machine's speed probes of `runs` (bench/machine_speed.py, before and
    after each run), or None where no run has them."""
    probes = [p for r in runs for p in (r.get("machine_speed") or {}).values() if p]
    if not probes:
        return None
    int8 = [p["int8_us"] for p in probes]
    stream = [p["stream_gbps"] for p in probes]
    return (f"- The machine's speed probe (bench/machine_speed.py, before and after each run): "
            f"a fixed int8 product took {min(int8):,.0f}-{max(int8):,.0f} µs "
            f"({max(int8) / min(int8):.2f}× between the fastest and the slowest), memory "
            f"streamed {min(stream):.1f}-{max(stream):.1f} GB/s. Cells whose probes are slow "
            f"ran on a slower machine, whatever the code did.")


def write_report(data: dict, doc: Path) -> Path:
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render(data, doc))
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path, default=RESULTS_DIR / "serving.json")
    ap.add_argument("--doc", type=Path, default=DOCS_DIR / "benchmarks.md")
    args = ap.parse_args()
    print(write_report(json.loads(args.results.read_text()), args.doc))


if __name__ == "__main__":
    main()
