"""Serving benchmark: seqgate against `transformers serve`, side by side, in one invocation.

    python -m bench.serving [--quick] [--phases sweep,agreement,cache,splitting] [--repeats 2]
                            [--sweep 1:16,8:48,32:96,64:128] [--servers seqgate,tf-serve,...]
    make bench [BENCH_ARGS="..."]

Every run starts its server on a free 127.0.0.1 port (bench/servers.py), warms it with two short
requests, runs a closed loop of streamed greedy chats (bench/loadgen.py), reads its memory and
stops it. Servers serve the same local SmolLM2 copy on the CPU: seqgate with its defaults,
`transformers serve` without (tf-serve) and with --continuous-batching (tf-serve-cb); llama.cpp's
server (xllamacpp) serves the GGUF that copy was de-quantised from, one slot per concurrent
request.

Phases:
  sweep      ShareGPT requests (first human turn; first reply's tokens as max_tokens, capped;
             prompts 4-1024 tokens) at each concurrency:requests pair; for each pair the servers
             run in turn, `--repeats` times (A B C A B C): seqgate/peer ratios pair adjacent runs.
             `--checkout DIR` adds seqgate from another checkout (an older commit) to the turn.
  agreement  the first --agreement-prompts requests, non-streamed: seqgate at each of
             --agreement-dtypes against each peer; same texts? where not, where they part.
  cache      the sweep's requests behind one shared ~430-token system prompt: seqgate with its
             prompt cache on versus --prompt-cache-bytes 0, interleaved.
  splitting  token-id prompts log-spaced over two orders of magnitude, exactly --split-new-tokens
             each, at --split-load: seqgate with max_splits 1, and 3 with max_sparsity 0.05,
             0.33 (the defaults), 1.0, interleaved; sub-batches per step from /metrics.
  speculative  two workloads at each --spec-load pair: the sweep's ShareGPT chats, and
             input-grounded rewriting (bench/workloads.py: "repeat this text, fixing any
             spelling mistakes" over ShareGPT replies, whose answers copy their prompt);
             --spec-servers in turn, `--repeats` times: seqgate with prompt-lookup drafts (its
             default) and without, llama.cpp plain and with its own n-gram speculation;
             acceptance and tokens per step from /metrics.
Raw results go to bench/results/serving.json (rewritten after every run), the report to
docs/benchmarks.md with PNG plots in docs/benchmarks/ (bench/report.py, bench/plots.py);
--quick writes bench/results/serving-quick.json and bench/results/quick/benchmarks.md instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from bench import isa_cap, machine_speed, openvino_peer, provenance
from bench.agreement import compare
from bench.figures import RequestResult, summarize
from bench.harness import DOCS_DIR, RESULTS_DIR
from bench.loadgen import run_closed_loop
from bench.report import without_native_kernels, write_report
from bench.scrape import engine_activity, scrape
from bench.servers import (
    SEQGATE,
    SPECULATIVE_SERVERS,
    SWEEP_SERVERS,
    CpuAccount,
    RssSampler,
    ServerError,
    ServerProcess,
    ServerSpec,
    local_model_dir,
    tree_peak_rss,
    tree_rss,
)
from bench.workloads import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    SYSTEM_PROMPT,
    agreement_bodies,
    for_server,
    grounded_bodies,
    prompt_cache_bodies,
    splitting_bodies,
    splitting_prompts,
    sweep_bodies,
)

RESULTS, DOCS = RESULTS_DIR, DOCS_DIR
PHASES = ("sweep", "agreement", "cache", "splitting", "speculative")
QUICK = {"sweep": "2:4", "repeats": 1, "max_tokens": 16, "agreement_prompts": 4,
         "cache_load": "2:4", "split_load": "4:8", "split_lengths": "10:300",
         "split_new_tokens": 8, "split_configs": "1:0.33,3:0.33", "spec_load": "1:2"}


def load_pairs(text: str) -> list[tuple[int, int]]:
    """"1:16,8:48" → [(1, 16), (8, 48)] (concurrency, requests)."""
    pairs = []
    for item in text.split(","):
        conc, _, count = item.strip().partition(":")
        pairs.append((int(conc), int(count or conc)))
    return pairs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: " + json.dumps(QUICK))
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--servers", default=",".join(SWEEP_SERVERS),
                    help="sweep/agreement servers, seqgate first: " + ",".join(SWEEP_SERVERS))
    ap.add_argument("--sweep", default="1:16,8:48,32:96,64:128", help="concurrency:requests,...")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs per server and level")
    ap.add_argument("--skip", action="append", default=[], metavar="SERVER@CONCURRENCY",
                    help="leave out one sweep cell (repeatable), e.g. tf-serve@64: without "
                         "continuous batching the peer serves one request at a time, so its high "
                         "levels only queue (and take most of the sweep's time)")
    ap.add_argument("--max-tokens", type=int, default=128, help="cap on each request's budget")
    ap.add_argument("--min-prompt", type=int, default=4)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle seed")
    ap.add_argument("--agreement-prompts", type=int, default=16)
    ap.add_argument("--agreement-concurrency", type=int, default=1)
    ap.add_argument("--agreement-dtypes", default="fp32,auto",
                    help="seqgate --dtype values to compare with the peers (the peers run the "
                         "weights' dtype, fp32; seqgate's auto may pick bf16)")
    ap.add_argument("--cache-load", default="8:32", help="concurrency:requests")
    ap.add_argument("--split-load", default="32:64", help="concurrency:requests")
    ap.add_argument("--split-lengths", default="10:1000", help="shortest:longest prompt tokens")
    ap.add_argument("--split-new-tokens", type=int, default=32)
    ap.add_argument("--split-configs", default="1:0.33,3:0.05,3:0.33,3:1.0",
                    help="max_splits:max_sparsity,... (max_sparsity is moot with max_splits 1)")
    ap.add_argument("--spec-load", default="1:12,4:24", help="concurrency:requests,... of the "
                    "speculative phase")
    ap.add_argument("--spec-servers", default="seqgate,seqgate-nospec,llama.cpp,llama.cpp-lookup",
                    help="speculative-phase servers: " + ",".join(SPECULATIVE_SERVERS))
    ap.add_argument("--seqgate-arg", action="append", default=[],
                    help="extra flag for every seqgate server (repeatable, e.g. "
                         "--seqgate-arg=--num-threads=1)")
    ap.add_argument("--peer-arg", action="append", default=[],
                    help="extra flag for every transformers serve (repeatable)")
    ap.add_argument("--checkout", type=Path, default=None,
                    help="sweep: also run seqgate from this other checkout (an older commit, "
                         "`python -m app serve` there), labelled seqgate@<commit>")
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="model directory for all servers (default: seqgate's safetensors "
                         "cache of the embedded SmolLM2)")
    ap.add_argument("--cap-isa", choices=sorted(isa_cap.CAPS), default=None,
                    help="cap seqgate and OpenVINO GenAI to this vector ISA (an AVX2 machine "
                         "approximated on an AVX512 one; bench/isa_cap.py)")
    ap.add_argument("--out", type=Path, default=None, help="raw results JSON")
    ap.add_argument("--doc", type=Path, default=None, help="markdown report (plots beside it)")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if ap.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    args.out = args.out or RESULTS / ("serving-quick.json" if args.quick else "serving.json")
    args.doc = args.doc or (RESULTS / "quick" / "benchmarks.md" if args.quick
                            else DOCS / "benchmarks.md")
    return args


class WarmUpError(RuntimeError):
    """A server started but failed its warm-up requests."""


class Bench:
    """One invocation: its arguments, the shared inputs, and the results as they accrue."""

    def __init__(self, args: argparse.Namespace, argv: list[str] | None):
        self.args = args
        cap = isa_cap.apply(args.cap_isa)  # before any server starts or torch computes
        self.model_dir = args.model_dir or local_model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        self.weights_dtype = config.get("dtype") or config.get("torch_dtype") or "?"
        command, shown = provenance.command(argv), dict(vars(args))
        if args.checkout is not None:  # no local paths in the results and the report
            command = command.replace(str(args.checkout), "DIR")
            shown["checkout"] = "DIR"
        meta = provenance.meta(argv, "bench.serving", command_line=command, started=True,
                               finished=False)
        self.data = {"meta": {**meta, "model_dir": str(self.model_dir),
                              "weights_dtype": self.weights_dtype,
                              "isa_cap": {"isa": args.cap_isa, "env": cap} if cap else None,
                              "args": provenance.jsonable(shown), "phase_seconds": {}},
                     "sweep": [], "agreement": {}, "cache": [], "splitting": [],
                     "speculative": [], "failures": []}
        self.logs = RESULTS / "logs"
        # An older commit's seqgate run beside this one in the sweep (`--checkout`).
        self.checkout = None if args.checkout is None else dataclasses.replace(
            self.spec(SEQGATE, label=f"seqgate@{provenance.commit_of(args.checkout)}"),
            checkout=args.checkout.resolve())

    def spec(self, base: ServerSpec, *extra: str, label: str | None = None) -> ServerSpec:
        own = self.args.seqgate_arg if base.kind == "seqgate" else self.args.peer_arg
        return dataclasses.replace(base, label=label or base.label,
                                   extra_args=base.extra_args + tuple(extra) + tuple(own))

    def save(self) -> None:
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(portable(json.dumps(self.data, indent=1, default=str)) + "\n")

    # -- one run ---------------------------------------------------------------------------------
    def measure(self, spec: ServerSpec, path: str, bodies: list[dict], concurrency: int,
                **tags) -> dict:
        """Start `spec`, warm it, run `bodies` in a closed loop, read memory and metrics, stop."""
        if spec.kind == "openvino":
            return self.measure_openvino(spec, bodies, concurrency, **tags)
        log = self.logs / f"{spec.label.replace(' ', '_').replace(',', '')}.log"
        with ServerProcess(spec, self.model_dir, log) as server:
            self._warm_up(server)
            info = _get_json(server.base_url + "/version") if spec.kind == "seqgate" else None
            idle_rss = server.rss()
            speed = {"before": machine_speed.probe()}
            before = scrape(server.base_url) if spec.kind == "seqgate" else None
            with RssSampler(server.pid) as sampler, CpuAccount(server.pid) as cpu:
                results, wall = run_closed_loop(server.base_url, path,
                                                for_server(bodies, server.request_model),
                                                concurrency, self.args.request_timeout)
            after = scrape(server.base_url) if spec.kind == "seqgate" else None
            speed["after"] = machine_speed.probe()
            peak = server.peak_rss()
            start_s = server.start_seconds
        run = _run_record(tags, spec.label, spec.argv(self.model_dir, 0)[1:], concurrency,
                          results, wall, (peak, idle_rss, sampler.peak), cpu, start_s,
                          engine=engine_activity(before, after) if before is not None else None,
                          server_info=info, machine_speed=speed)
        if without_native_kernels(info):
            print(f"  WARNING: {spec.label} runs without any native kernel (see its log: the "
                  "library did not build?), so its figures measure PyTorch's fallback",
                  flush=True)
        f = run["figures"]
        print(f"  {spec.label:<44} c={concurrency:<3} {f['completed']}/{f['requests']} ok, "
              f"{f['output_tokens_per_s']:7.2f} tok/s, TTFT p50 {_s(f['ttft_p50'])}, "
              f"TPOT p50 {_s(f['tpot_p50'])}, peak RSS {peak / 2**20:,.0f} MiB, "
              f"{f['wall_seconds']:.1f}s (+{start_s:.1f}s start), other CPU load "
              f"{cpu.other_cores:.2f} cores, probe int8 {speed['before']['int8_us']:.0f}/"
              f"{speed['after']['int8_us']:.0f} µs", flush=True)
        return run

    def measure_openvino(self, spec: ServerSpec, bodies: list[dict], concurrency: int,
                         **tags) -> dict:
        """measure() for OpenVINO GenAI, driven in its own process without HTTP: the same
        prompts through the same chat template, as token ids, with the same budgets."""
        requests = [{"prompt_ids": self.tokenizer.apply_chat_template(
                        b["messages"], add_generation_prompt=True, tokenize=True,
                        return_dict=True)["input_ids"], "max_tokens": b["max_tokens"]}
                    for b in bodies]
        ov_dir = openvino_peer.export(self.model_dir, spec.extra_args[0])
        work = self.logs / spec.label
        with openvino_peer.OpenVINORun(ov_dir, requests, concurrency, work) as driver:
            idle_rss = tree_rss(driver.pid)
            speed = {"before": machine_speed.probe()}
            with RssSampler(driver.pid) as sampler, CpuAccount(driver.pid) as cpu:
                out = driver.run()
            speed["after"] = machine_speed.probe()
            peak = tree_peak_rss(driver.pid)
        results = [RequestResult(**r) for r in out["results"]]
        run = _run_record(tags, spec.label, spec.argv(self.model_dir, 0), concurrency, results,
                          out["wall_seconds"], (peak, idle_rss, sampler.peak), cpu,
                          driver.start_seconds, in_process=True, engine=None,
                          server_info=None, machine_speed=speed)
        f = run["figures"]
        print(f"  {spec.label + ' (in-process)':<44} c={concurrency:<3} {f['completed']}/"
              f"{f['requests']} ok, {f['output_tokens_per_s']:7.2f} tok/s, TTFT p50 "
              f"{_s(f['ttft_p50'])}, TPOT p50 {_s(f['tpot_p50'])}, {f['wall_seconds']:.1f}s "
              f"(+{driver.start_seconds:.1f}s start)", flush=True)
        return run

    def record(self, phase: str, spec: ServerSpec, path: str, bodies: list[dict],
               concurrency: int, **tags) -> None:
        """measure() into data[phase]; a server that fails to start or warm up is noted in
        data["failures"] and the invocation goes on."""
        try:
            self.data[phase].append(self.measure(spec, path, bodies, concurrency, phase=phase,
                                                 **tags))
        except (ServerError, WarmUpError, httpx.HTTPError, OSError, RuntimeError,
                subprocess.SubprocessError) as exc:
            self.fail(phase, spec, exc, concurrency=concurrency, **tags)
        self.save()

    def fail(self, phase: str, spec: ServerSpec, exc: Exception, **tags) -> None:
        print(f"  {spec.label}: FAILED: {exc}", flush=True)
        self.data["failures"].append({"phase": phase, "server": spec.label, **tags,
                                      "error": str(exc)})

    def _warm_up(self, server: ServerProcess) -> None:
        """Two short requests, untimed: transformers serve sets up continuous batching on its
        first request (about 10 s here), and every server pays first-call costs."""
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
                "temperature": 0, "stream": True}
        results, _ = run_closed_loop(server.base_url, CHAT_PATH,
                                     for_server([body, body], server.request_model), 1, 600.0)
        errors = [r.error for r in results if not r.ok]
        if errors:
            raise WarmUpError(f"{server.spec.label}: warm-up failed: {errors[0]}\n"
                              f"{server.log_tail()}")

    # -- phases ----------------------------------------------------------------------------------
    def requests(self, count: int):
        from bench.sharegpt import load_requests

        return load_requests(self.tokenizer, count, seed=self.args.seed,
                             min_prompt=self.args.min_prompt, max_prompt=self.args.max_prompt,
                             max_output=self.args.max_tokens)

    def sweep_servers(self) -> list[ServerSpec]:
        specs = [self.spec(SWEEP_SERVERS[name]) for name in self.args.servers.split(",")]
        return specs if self.checkout is None else [*specs, self.checkout]

    def run_sweep(self) -> None:
        levels = load_pairs(self.args.sweep)
        reqs = self.requests(max(n for _, n in levels))
        for conc, n in levels:
            print(f"[sweep] concurrency {conc}, {n} requests", flush=True)
            for rep in range(self.args.repeats):
                for spec in self.sweep_servers():
                    if f"{spec.label}@{conc}" in self.args.skip:
                        continue
                    self.record("sweep", spec.for_concurrency(conc), CHAT_PATH,
                                sweep_bodies(reqs[:n]), conc, repeat=rep)

    def run_speculative(self) -> None:
        levels = load_pairs(self.args.spec_load)
        most = max(n for _, n in levels)
        workloads = {"sharegpt": sweep_bodies(self.requests(most)),
                     "grounded": grounded_bodies(self.tokenizer, most, self.args.seed,
                                                 self.args.max_tokens)}
        specs = [self.spec(SPECULATIVE_SERVERS[name])
                 for name in self.args.spec_servers.split(",")]
        for name, bodies in workloads.items():
            for conc, n in levels:
                print(f"[speculative] {name}, concurrency {conc}, {n} requests", flush=True)
                for rep in range(self.args.repeats):
                    for spec in specs:
                        self.record("speculative", spec.for_concurrency(conc), CHAT_PATH,
                                    bodies[:n], conc, repeat=rep, workload=name)

    def run_agreement(self) -> None:
        reqs = self.requests(self.args.agreement_prompts)
        print(f"[agreement] {len(reqs)} prompts, non-streamed greedy", flush=True)
        ours = [self.spec(SEQGATE, *(("--dtype", d) if d != "auto" else ()),
                          label="seqgate" if d == "auto" else f"seqgate --dtype {d}")
                for d in self.args.agreement_dtypes.split(",")]
        # OpenVINO's driver returns timings, not texts: it is in the sweep only.
        peers = [s for s in self.sweep_servers() if s.kind not in ("seqgate", "openvino")]
        outputs, section = {}, self.data["agreement"]
        section.update(outputs={}, dtypes={}, comparisons={})
        for spec in ours + peers:
            log = self.logs / f"agreement-{spec.label.replace(' ', '_')}.log"
            bodies = agreement_bodies(reqs, top_logprobs=spec.kind == "seqgate")
            try:
                with ServerProcess(spec, self.model_dir, log) as server:
                    self._warm_up(server)
                    info = (_get_json(server.base_url + "/version")
                            if spec.kind == "seqgate" else {})
                    section["dtypes"][spec.label] = ((info or {}).get("dtype")
                                                     or self.weights_dtype)
                    outputs[spec.label], _ = run_closed_loop(
                        server.base_url, CHAT_PATH, for_server(bodies, server.request_model),
                        self.args.agreement_concurrency, self.args.request_timeout,
                        keep_text=True)
            except (ServerError, WarmUpError, httpx.HTTPError) as exc:
                self.fail("agreement", spec, exc)
                continue
            section["outputs"][spec.label] = [r.to_json(keep_text=True)
                                              for r in outputs[spec.label]]
            self.save()
        for a in (s for s in ours if s.label in outputs):
            for b in (s for s in peers if s.label in outputs):
                c = compare(outputs[a.label], outputs[b.label], self.tokenizer)
                section["comparisons"][f"{a.label} vs {b.label}"] = c
                print(f"  {a.label} ({section['dtypes'][a.label]}) vs {b.label} "
                      f"({section['dtypes'][b.label]}): {c['matches']}/{c['prompts']} identical",
                      flush=True)
        self.save()

    def run_cache(self) -> None:
        conc, n = load_pairs(self.args.cache_load)[0]
        reqs = self.requests(n)
        self.data["meta"]["system_prompt_tokens"] = len(self.tokenizer.encode(SYSTEM_PROMPT))
        specs = [self.spec(SEQGATE, label="seqgate cache on"),
                 self.spec(SEQGATE, "--prompt-cache-bytes", "0", label="seqgate cache off")]
        print(f"[cache] concurrency {conc}, {n} requests behind one system prompt", flush=True)
        for rep in range(self.args.repeats):
            for spec in specs:
                self.record("cache", spec, CHAT_PATH, prompt_cache_bodies(reqs), conc,
                            repeat=rep)

    def run_splitting(self) -> None:
        conc, n = load_pairs(self.args.split_load)[0]
        lo, _, hi = self.args.split_lengths.partition(":")
        prompts = splitting_prompts(self.tokenizer, n, int(lo), int(hi), self.args.seed)
        self.data["meta"]["splitting_prompt_lengths"] = [len(p) for p in prompts]
        bodies = splitting_bodies(prompts, self.args.split_new_tokens)
        configs = [(int(a), float(b)) for a, _, b in
                   (c.strip().partition(":") for c in self.args.split_configs.split(","))]
        print(f"[splitting] concurrency {conc}, {n} prompts of {lo}-{hi} tokens", flush=True)
        for rep in range(self.args.repeats):
            for splits, sparsity in configs:
                label = split_label(splits, sparsity)
                spec = self.spec(SEQGATE, "--max-splits", str(splits), "--max-sparsity",
                                 str(sparsity), label=f"seqgate {label}")
                self.record("splitting", spec, COMPLETIONS_PATH, bodies, conc, repeat=rep,
                            config=label, max_splits=splits, max_sparsity=sparsity)


def _run_record(tags: dict, label: str, argv: list[str], concurrency: int,
                results: list[RequestResult], wall: float, memory: tuple[int, int, int],
                cpu: CpuAccount, start_seconds: float | None, **extra) -> dict:
    """One run as serving.json keeps it; `memory`: (peak, idle, run's peak) RSS."""
    peak, idle, run_peak = memory
    return {**tags, "server": label, "argv": argv, "concurrency": concurrency, **extra,
            "figures": summarize(results, wall),
            "memory": {"peak_rss": peak, "idle_rss": idle, "run_peak_rss": run_peak,
                       "run_growth": run_peak - idle},
            "cpu": cpu.to_json(), "start_seconds": start_seconds,
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "requests": [r.to_json() for r in results]}


def portable(text: str) -> str:
    """The results without this machine's paths: the checkout becomes `.`, the home folder `~`
    (the results are committed beside the report)."""
    repo = str(Path(__file__).resolve().parent.parent)
    text = text.replace(repo + "/", "./").replace(json.dumps(repo)[1:-1], ".")
    return text.replace(str(Path.home()) + "/", "~/")


def split_label(max_splits: int, max_sparsity: float) -> str:
    if max_splits == 1:
        return "max_splits=1"
    label = f"max_splits={max_splits}, max_sparsity={max_sparsity:g}"
    return label + " (defaults)" if (max_splits, max_sparsity) == (3, 0.33) else label


def _get_json(url: str) -> dict | None:
    try:
        return httpx.get(url, timeout=10.0).json()
    except (httpx.HTTPError, ValueError):
        return None


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}s"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bench = Bench(args, argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phase(s) {sorted(unknown)}; choose from {PHASES}")
    print(f"model {bench.model_dir}\nresults {args.out}\nreport {args.doc}", flush=True)
    try:
        for phase in phases:
            t0 = time.perf_counter()
            getattr(bench, f"run_{phase}")()
            bench.data["meta"]["phase_seconds"][phase] = time.perf_counter() - t0
    finally:
        bench.data["meta"]["finished"] = provenance.now()
        bench.save()

        # From the saved results, which hold no paths of this machine (`portable`).
        report = write_report(json.loads(args.out.read_text()), args.doc)
        print(f"wrote {args.out} and {report}")


if __name__ == "__main__":
    main()
