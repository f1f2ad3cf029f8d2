"""The soak's figures and targets from its raw outcomes, and the markdown report
(docs/reliability.md) rendered from them.

    python -m bench.soak_report [bench/results/soak.json] [--report docs/reliability.md]

re-renders the report from a results file without rerunning anything.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import markdown_table
from bench.soak_traffic import Outcome

RSS_GROWTH_LIMIT = 0.05
STALL_SECONDS = 30.0  # with clients waiting, this long without a single answer is a stall
BAD_INPUT_SECONDS = 5.0  # refusing bad input is parsing and checks, never queueing for the engine
ABORT_FREE_STEPS = 3.0
FUZZ_MIN_CASES = 5000
SHOWN_PROBLEMS = 25


def category(o: Outcome) -> str:
    """The outcome row a request counts in."""
    if o.cut:
        return "client-disconnected"
    if o.status is None:
        return "no-answer"
    if o.status == 200:
        if o.stream_end in ("truncated", "error-no-done"):
            return "stream-truncated"
        if o.stream_end == "error-then-done":
            return "503" if o.unavailable else f"stream-error:{o.code}"
        return "ok"
    if o.status in (429, 503):
        return str(o.status)
    if o.status >= 500:
        return "5xx"
    if o.status >= 400:
        return f"4xx:{o.code}"
    return f"other:{o.status}"


def drain_ending(o: Outcome) -> str:
    """How a request in flight at SIGTERM ended: `completed`, `service-unavailable` (HTTP 503 or
    an SSE error event then [DONE]), `client-cut`, `refused-bad-input`, or `other` (a finding)."""
    if o.cut:
        return "client-cut"
    if o.problem:
        return "other"
    if o.status == 200 and o.stream_end in (None, "done"):
        return "completed"
    if o.unavailable and o.status in (200, 503):
        return "service-unavailable"
    if o.bad and o.status is not None and 400 <= o.status < 500:
        return "refused-bad-input"
    return "other"


@dataclass(frozen=True)
class Target:
    """One figure with its target: `passed` None when it could not be measured."""

    figure: str
    value: str
    target: str
    passed: bool | None


def longest_silence(outcomes: Sequence[Outcome], until: float) -> float:
    """The longest stretch in [0, until] in which the server answered nothing (client cuts and
    unanswered requests prove no progress): a closed loop always has requests waiting, so a long
    silence is a stalled server, whatever else the figures say."""
    ends = sorted(o.ended for o in outcomes
                  if not o.probe and not o.cut and o.status is not None and o.ended <= until)
    marks = [0.0, *ends, until]
    return max(b - a for a, b in zip(marks, marks[1:]))


def traffic_summary(outcomes: Sequence[Outcome], sigterm_at: float | None) -> dict:
    """Requests by outcome and the findings among them (probes are reported with the drain)."""
    sent = [o for o in outcomes if not o.probe]
    by_category = Counter(category(o) for o in sent)
    bad = [o for o in sent if o.bad]
    bad_table = Counter((o.kind.removeprefix("bad:"), o.status, o.code) for o in bad)
    slowest: dict[tuple, float] = {}
    for o in bad:
        key = (o.kind.removeprefix("bad:"), o.status, o.code)
        slowest[key] = max(slowest.get(key, 0.0), o.ended - o.started)
    early_503 = [o for o in sent if o.status == 503 and sigterm_at is not None
                 and o.ended < sigterm_at]
    last = sigterm_at if sigterm_at is not None else max((o.ended for o in sent), default=0.0)
    return {
        "requests": len(sent),
        "longest_silence_seconds": longest_silence(sent, last),
        "by_category": dict(sorted(by_category.items())),
        "answered_ok": sum(category(o) == "ok" and (sigterm_at is None or o.ended < sigterm_at)
                           for o in sent),
        "by_kind": dict(sorted(Counter(o.kind for o in sent).items())),
        "bad_input": [{"input": k, "status": s, "code": c, "count": n,
                       "slowest_seconds": slowest[k, s, c]}
                      for (k, s, c), n in sorted(bad_table.items(), key=str)],
        "bad_input_mishandled": [o.to_json() for o in bad if o.problem],
        "server_errors": [o.to_json() for o in sent if category(o) == "5xx"],
        "no_answer": [o.to_json() for o in sent if category(o) == "no-answer"],
        "truncated_streams": [o.to_json() for o in sent if category(o) == "stream-truncated"],
        "unavailable_before_sigterm": [o.to_json() for o in early_503],
        "problems": [o.to_json() for o in sent if o.problem],
    }


def drain_summary(outcomes: Sequence[Outcome], sigterm_at: float) -> dict:
    """How the requests in flight at SIGTERM ended, and what the drain's probes got."""
    in_flight = [o for o in outcomes if not o.probe and o.started < sigterm_at <= o.ended]
    probes = [o for o in outcomes if o.probe]
    return {
        "sigterm_at": sigterm_at,
        "in_flight": len(in_flight),
        "endings": dict(sorted(Counter(drain_ending(o) for o in in_flight).items())),
        "other": [o.to_json() for o in in_flight if drain_ending(o) == "other"],
        "probes": [o.to_json() for o in probes],
        "probes_unavailable": sum(o.status == 503 and o.unavailable for o in probes),
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def response_store_target(readings: Sequence[Sequence[float]] | None,
                          bound: int | None) -> Target:
    """The /v1/responses store's peak bytes over the run's readings against its bound."""
    figure = "/v1/responses store: peak bytes of the readings"
    if not readings or bound is None:
        return Target(figure, "n/a", "<= its bound", None)
    _, entries, peak = max(readings, key=lambda r: r[2])
    return Target(figure, f"{peak / 1024:,.0f} KiB ({entries:.0f} responses)",
                  f"<= {bound / 1024:,.0f} KiB", peak <= bound)


def targets(data: dict) -> list[Target]:
    t, d, rss, server = data["traffic"], data["drain"], data["rss"], data["server"]
    metrics, fuzz = data.get("metrics") or {}, data.get("fuzz")
    endings = d["endings"]
    slowest_bad = max((b["slowest_seconds"] for b in t["bad_input"]
                       if b["status"] and 400 <= b["status"] < 500), default=None)
    out = [
        Target("server ran until SIGTERM", "yes" if server.get("died_at") is None else
               f"no: exited with code {server['exit_code']} at {server['died_at']:.1f} s", "yes",
               server.get("died_at") is None),
        Target("requests answered 200 before SIGTERM", str(t["answered_ok"]), "> 0",
               t["answered_ok"] > 0),
        Target("longest time without any answer (before SIGTERM)",
               f"{t['longest_silence_seconds']:.1f} s", f"< {STALL_SECONDS:g} s",
               t["longest_silence_seconds"] < STALL_SECONDS),
        Target("5xx answers (other than 503)", str(len(t["server_errors"])), "0",
               not t["server_errors"]),
        Target("requests with no HTTP answer", str(len(t["no_answer"])), "0", not t["no_answer"]),
        Target("streams without [DONE] or an error event (client cuts excluded)",
               str(len(t["truncated_streams"])), "0", not t["truncated_streams"]),
        Target("bad inputs not refused with a 4xx error envelope",
               str(len(t["bad_input_mishandled"])), "0", not t["bad_input_mishandled"]),
        Target("slowest 4xx refusal of bad input", f"{slowest_bad:.2f} s" if slowest_bad is not None
               else "n/a", f"< {BAD_INPUT_SECONDS:g} s",
               None if slowest_bad is None else slowest_bad < BAD_INPUT_SECONDS),
        Target("503 before SIGTERM", str(len(t["unavailable_before_sigterm"])), "0",
               not t["unavailable_before_sigterm"]),
        Target("answers judged wrong, all kinds", str(len(t["problems"])), "0",
               not t["problems"]),
        Target("in flight at SIGTERM: ended otherwise than completed / 503",
               f"{endings.get('other', 0)} of {d['in_flight']}", "0", not endings.get("other")),
        Target("drain probes answered 503 service_unavailable",
               f"{d['probes_unavailable']} of {len(d['probes'])}", "all",
               d["probes_unavailable"] == len(d["probes"]) if d["probes"] else None),
        Target("server exit after SIGTERM",
               f"code {server['exit_code']} in {server['exit_seconds']:.1f} s"
               if server.get("exit_seconds") is not None else "did not exit",
               f"code 0 within {server['exit_deadline']:.0f} s",
               server.get("exit_code") == 0 and not server.get("killed")),
        Target("RSS growth after warm-up (median of the first and last "
               f"{rss.get('window_seconds', 0):.0f} s of load)", _pct(rss.get("median_growth")),
               f"< {100 * RSS_GROWTH_LIMIT:.0f}%", None if rss.get("median_growth") is None
               else rss["median_growth"] < RSS_GROWTH_LIMIT),
    ]
    out.append(response_store_target(rss.get("response_store"),
                                     server.get("response_store_bytes")))
    free = metrics.get("abort_free")
    out.append(Target(f"aborted slots freed within {ABORT_FREE_STEPS:g} engine steps",
                      "n/a (metric absent)" if free is None else
                      f"{_pct(free['fraction'])} ({free['within']:g} of {free['count']:g})",
                      "100%", None if free is None or not free["count"]
                      else free["within"] == free["count"]))
    if fuzz is None:
        out.append(Target("schemathesis", "skipped", "", None))
    else:
        out.append(Target("schemathesis cases", f"{fuzz['cases']:,}", f">= {FUZZ_MIN_CASES:,}",
                          fuzz["cases"] >= FUZZ_MIN_CASES))
        out.append(Target("schemathesis failures", f"{fuzz['failed']} failed, rc {fuzz['rc']}",
                          "0", fuzz["failed"] == 0 and fuzz["rc"] == 0))
    return out


def _verdict(passed: bool | None) -> str:
    return "n/a" if passed is None else ("pass" if passed else "**FAIL**")


def _problem_lines(items: Sequence[dict], title: str) -> list[str]:
    if not items:
        return []
    lines = [f"### {title} ({len(items)})", ""]
    for o in items[:SHOWN_PROBLEMS]:
        lines.append(f"- `{o['kind']}` at {o['started']:.1f}-{o.get('ended', 0):.1f} s, status "
                     f"{o.get('status', 'none')}: {o.get('problem', '')}")
        if o.get("body"):
            lines.append(f"  ```\n  {o['body'][:600]}\n  ```")
    if len(items) > SHOWN_PROBLEMS:
        lines.append(f"- ... and {len(items) - SHOWN_PROBLEMS} more (in the JSON)")
    return lines + [""]


def _header(data: dict) -> list[str]:
    meta, m, v = data["meta"], data["meta"]["machine"], data["meta"]["versions"]
    return [
        "# Reliability: soak and fault run", "",
        "Generated by `bench/soak.py` (`make soak`); rerun with:", "",
        f"    {meta['command']}", "",
        f"- Date: {meta['started']} to {meta.get('finished', '?')}",
        f"- Machine: {m['cpu']}, {m['cores_available']} cores available, {m['memory_gib']} GiB, "
        f"{m['os']}; load average at start {m['load_avg_1m_at_start']}",
        f"- Versions: seqgate {v.get('seqgate')} ({(v.get('seqgate_git_sha') or '?')[:10]}"
        f"{', dirty tree' if v.get('seqgate_git_dirty') else ''}), torch {v.get('torch')}, "
        f"transformers {v.get('transformers')}, Python {v.get('python')}",
        f"- Load: {meta['args']['concurrency']} closed-loop clients for "
        f"{meta['args']['duration']} s; SIGTERM at {data['drain']['sigterm_at']:.1f} s with "
        f"--drain-timeout {meta['args']['drain_timeout']:g}; seed {meta['args']['seed']}",
        *_cpu_lines(data.get("cpu")),
        "",
    ]


def _cpu_lines(cpu: dict | None) -> list[str]:
    if not cpu:
        return []
    busy = " (a busy machine: throughput and timings are low)" if cpu["other_cores"] > 0.5 else ""
    return [f"- CPU while loaded, in cores: server {cpu['server_cores']:.2f}, load generator "
            f"{cpu['loadgen_cores']:.2f}, other processes {cpu['other_cores']:.2f}{busy}"]


def _metrics_lines(metrics: dict) -> list[str]:
    lines = ["## Engine metrics (scraped before SIGTERM)", ""]
    work = [f"{metrics[k]:,.0f} {k.replace('_', ' ')}" for k in
            ("engine_steps", "prompt_tokens", "generated_tokens") if metrics.get(k) is not None]
    if work:
        lines.append("- Work done: " + ", ".join(work))
    step = metrics.get("step_seconds")
    if step and step.get("count"):
        longest = ("over the largest bucket" if step["max_le"] is None
                   else f"<= {step['max_le']:g} s")
        lines.append(f"- Engine step time: mean {step['mean']:.3f} s over {step['count']:,.0f} "
                     f"steps, longest {longest}")
    free = metrics.get("abort_free")
    lines.append("- `seqgate_abort_free_steps`: " + (
        "n/a (not exposed)" if free is None else
        f"{free['within']:g} of {free['count']:g} aborts freed their slot within "
        f"{ABORT_FREE_STEPS:g} steps ({_pct(free['fraction'])})"))
    outcomes = metrics.get("request_outcomes")
    if not outcomes:
        return lines + ["- `seqgate_request_outcomes_total`: n/a (not exposed)", ""]
    names = sorted({k for per in outcomes.values() for k in per})
    disconnects = sum(per.get("client_disconnected", 0) for per in outcomes.values())
    if free is not None and free["count"] < disconnects:
        lines.append(f"- {disconnects:g} requests counted as client_disconnected, but only "
                     f"{free['count']:g} aborts observed in `seqgate_abort_free_steps` by the "
                     "time of the scrape")
    lines += ["", "`seqgate_request_outcomes_total`:", "",
              markdown_table(["route", *names],
                             [[r, *(int(per.get(k, 0)) for k in names)]
                              for r, per in sorted(outcomes.items())]), ""]
    return lines


def _fuzz_lines(fuzz: dict | None) -> list[str]:
    if fuzz is None:
        return ["## Schemathesis", "", "Skipped (--skip-fuzz).", ""]
    lines = ["## Schemathesis", "",
             f"`{fuzz['command']}`: {fuzz['cases']:,} cases, {fuzz['passed']} tests passed, "
             f"{fuzz['failed']} failed, exit code {fuzz['rc']}, {fuzz['seconds']:.0f} s.", ""]
    for run, statuses in sorted(fuzz["statuses"].items()):
        lines.append(f"- {run} responses by status: "
                     + ", ".join(f"{s}: {n:,}" for s, n in sorted(statuses.items())))
    return lines + [""]


def _warmup_lines(rss: dict) -> list[str]:
    """Why the warm-up lasted as long as it did: the prefix cache grows by design until full."""
    cache = rss.get("prefix_cache")
    if not cache:
        return []
    if not cache.get("budget"):
        return ["The prefix cache was off (budget 0): the warm-up is the fixed part alone.", ""]
    state = ("until it first evicted (full)" if cache.get("full") else
             "but it had not filled when the wait ended (at most half the run)")
    return [f"The warm-up went on {cache.get('seconds', 0):.0f} s past its fixed part, while the "
            f"prefix cache filled up to its budget of {_mib(cache['budget'])}, {state}: "
            f"{_mib(cache.get('bytes'))} held then.", ""]


def _series_lines(series: list | None) -> list[str]:
    if not series:
        return []
    return ["Sampled during the run (s: MiB): "
            + ", ".join(f"{t:g}: {n / 2**20:,.0f}" for t, n in series), ""]


def _held_lines(metrics: dict) -> list[str]:
    held = [f"{label} {_mib(int(metrics[k]))}" for k, label in
            (("prompt_cache_bytes", "prompt cache"), ("kv_cache_bytes", "rolling-batch KV"),
             ("kv_cache_peak_bytes", "rolling-batch KV peak")) if metrics.get(k) is not None]
    if not held:
        return []
    return ["Held by the engine at the end (/metrics): " + ", ".join(held) + ".", ""]


def render(data: dict) -> str:
    t, d, rss = data["traffic"], data["drain"], data["rss"]
    lines = _header(data)
    lines += ["## Targets", "",
              markdown_table(["figure", "value", "target", "verdict"],
                             [[x.figure, x.value, x.target, _verdict(x.passed)]
                              for x in targets(data)]), ""]
    lines += [f"## Requests by outcome ({t['requests']:,} sent)", "",
              markdown_table(["outcome", "requests"], sorted(t["by_category"].items())), "",
              "Bad input, by what came back:", "",
              markdown_table(["input", "status", "code", "requests", "slowest (s)"],
                             [[b["input"], b["status"] or "none", b["code"] or "-", b["count"],
                               b["slowest_seconds"]] for b in t["bad_input"]]), ""]
    lines += ["## Shutdown drain", "",
              f"{d['in_flight']} requests were in flight at SIGTERM; they ended thus:", "",
              markdown_table(["ending", "requests"], sorted(d["endings"].items())), "",
              f"Probes sent during the drain: {len(d['probes'])}, answered "
              + (", ".join(f"{p.get('status', 'none')} {p.get('code') or p.get('problem', '')}"
                           for p in d["probes"]) or "-") + ".", ""]
    lines += ["## Memory (RSS of the server's process tree)", "",
              *_warmup_lines(rss),
              markdown_table(["when", "RSS"], [
                  ["start (/health 200)", _mib(rss.get("start"))],
                  [f"after warm-up ({rss['warmup_seconds']:.0f} s, "
                   f"{rss.get('warmup_answers', '?')} requests answered)", _mib(rss.get("warm"))],
                  ["end (before SIGTERM)", _mib(rss.get("end"))],
                  ["peak while loaded (sampled each second)", _mib(rss.get("peak"))],
                  ["growth after warm-up (these two samples)", _pct(rss.get("growth"))],
                  [f"median of the first / last {rss.get('window_seconds', 0):.0f} s of load",
                   f"{_mib(rss.get('warm_median'))} / {_mib(rss.get('end_median'))}"],
                  ["growth after warm-up, medians (the target)", _pct(rss.get("median_growth"))],
                  ["KV held by the engine (rolling batch + prefix cache) at warm-up / at the end",
                   f"{_mib(rss.get('kv_warm'))} / {_mib(rss.get('kv_end'))}"],
                  ["growth after warm-up, net of that KV", _pct(rss.get("growth_net_of_kv"))],
                  ]), "",
              *_series_lines(rss.get("series")),
              *_held_lines(data.get("metrics") or {})]
    lines += _metrics_lines(data.get("metrics") or {})
    lines += _fuzz_lines(data.get("fuzz"))
    findings = (_problem_lines(t["server_errors"], "5xx answers")
                + _problem_lines(t["no_answer"], "Requests with no answer")
                + _problem_lines(t["truncated_streams"], "Truncated streams")
                + _problem_lines(t["bad_input_mishandled"], "Bad input not refused")
                + _problem_lines(d["other"], "In flight at SIGTERM, ended badly")
                + _problem_lines([p for p in t["problems"] if p not in t["server_errors"]
                                  + t["no_answer"] + t["truncated_streams"]
                                  + t["bad_input_mishandled"]], "Other answers judged wrong"))
    server = data["server"]
    if server.get("log_errors"):
        findings += [f"### Server log: {len(server['log_errors'])} ERROR and exception lines", "",
                     "```", *server["log_errors"][:SHOWN_PROBLEMS], "```", ""]
    failed = [f"- {x.figure}: {x.value} (target {x.target})" for x in targets(data)
              if x.passed is False]
    if failed:
        findings = ["### Targets missed", "", *failed, "", *findings]
    lines += ["## Findings", "", *(findings or ["None.", ""])]
    return "\n".join(lines).rstrip() + "\n"


def write_report(data: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(data))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path,
                    default=Path(__file__).resolve().parent / "results" / "soak.json")
    ap.add_argument("--report", type=Path,
                    default=Path(__file__).resolve().parent.parent / "docs" / "reliability.md")
    args = ap.parse_args()
    print(write_report(json.loads(args.results.read_text()), args.report))


if __name__ == "__main__":
    main()
