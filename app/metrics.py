"""Prometheus metrics for one app: HTTP requests, engine steps, tokens, latency.

Each app gets its own CollectorRegistry so several apps (tests) never collide. Engine totals are
read from `engine.stats()` at scrape time rather than mirrored into counters, so they cannot
drift; per-step distributions come from the engine's step listener (engine thread; prometheus
client metrics are thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import EngineClient, StepStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Reads the engine's counters and gauges when Prometheus scrapes."""

    def __init__(self, get_engine: Callable[[], EngineClient | None]):
        self._get_engine = get_engine

    def collect(self):
        engine = self._get_engine()
        if engine is None:
            return
        s = engine.stats()
        yield GaugeMetricFamily("seqgate_queue_depth", "Jobs waiting for a batch slot",
                                value=s.queued)
        yield GaugeMetricFamily("seqgate_running_sequences", "Sequences in the rolling batch",
                                value=s.running)
        yield GaugeMetricFamily("seqgate_prompt_cache_bytes", "Bytes held by the prefix cache",
                                value=s.prefix_cache_bytes)
        yield GaugeMetricFamily("seqgate_prompt_cache_budget_bytes", "Most bytes the prefix "
                                "cache may hold (--prompt-cache-bytes, within the KV budget; "
                                "0: off)", value=s.prefix_cache_capacity_bytes)
        yield GaugeMetricFamily("seqgate_prompt_cache_entries", "Nodes of the prefix cache's "
                                "radix tree holding KV", value=s.prefix_cache_entries)
        yield GaugeMetricFamily("seqgate_kv_cache_bytes", "Bytes held by the rolling batch's KV "
                                "(padding included; on the CPU, columns reserved for tokens to "
                                "come count once written)", value=s.kv_bytes)
        yield GaugeMetricFamily("seqgate_kv_cache_peak_bytes", "Most bytes the rolling batch's KV "
                                "held after any step since start", value=s.peak_kv_bytes)
        yield GaugeMetricFamily("seqgate_kv_cache_budget_bytes", "Most bytes the rolling batch's "
                                "KV may hold: the KV budget (--kv-cache-bytes or "
                                "--gpu-memory-utilization) less the prefix cache's; 0: none",
                                value=s.kv_budget_bytes)
        rate = s.spec_accepted_tokens / s.spec_proposed_tokens if s.spec_proposed_tokens else 0.0
        yield GaugeMetricFamily("seqgate_spec_acceptance_rate", "Share of the draft tokens fed "
                                "that verification kept, since start (0: none fed)", value=rate)
        counters = (
            ("seqgate_engine_steps", "Engine steps run", s.steps),
            ("seqgate_prompt_tokens", "Prompt tokens submitted to the engine", s.prompt_tokens),
            ("seqgate_generated_tokens", "Tokens generated", s.generated_tokens),
            ("seqgate_prompt_cache_hits", "Prefills that reused a cached prefix of their prompt",
             s.cache_hits),
            ("seqgate_prompt_cache_misses", "Prefills that found no cached prefix to reuse",
             s.cache_misses),
            ("seqgate_prompt_cache_cached_tokens", "Prompt tokens whose KV came from the cache",
             s.cached_tokens),
            ("seqgate_prompt_cache_evictions", "Radix-tree nodes evicted from the prefix cache",
             s.prefix_cache_evictions),
            ("seqgate_grammars_compiled", "Grammars compiled (response_format, tools, guided_*) "
             "that were not in the compile cache", s.grammars_compiled),
            ("seqgate_grammar_masked_tokens", "Tokens chosen under a grammar's mask",
             s.grammar_masked_tokens),
            ("seqgate_grammar_mask_seconds", "Engine time spent computing and applying grammar "
             "masks", s.grammar_mask_seconds),
            ("seqgate_out_of_memory_steps", "Engine steps an allocation failure undid (the "
             "engine went on)", s.out_of_memory_steps),
            ("seqgate_preemptions", "Jobs put back on the queue to be recomputed after an "
             "allocation failure", s.preemptions),
            ("seqgate_spec_proposed_tokens", "Draft tokens fed for verification (speculative "
             "decoding by prompt lookup)", s.spec_proposed_tokens),
            ("seqgate_spec_accepted_tokens", "Draft tokens verification kept",
             s.spec_accepted_tokens),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily("seqgate_sequences_finished", "Sequences finished",
                                       labels=["reason"])
        for reason, count in sorted(s.finished_by_reason.items()):
            finished.add_metric([str(reason)], count)
        yield finished


class GatewayMetrics:
    """Owns the app's registry and every metric the gateway records."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine: EngineClient | None = None
        self.registry.register(_EngineCollector(lambda: self._engine))
        self.requests = Counter("seqgate_http_requests", "HTTP responses by route and status "
                                "(a stream counts its status when it starts)",
                                ["route", "status"], registry=self.registry)
        self.outcomes = Counter("seqgate_request_outcomes", "Requests that reached the engine, "
                                "by how they ended: finished, client_disconnected, failed, "
                                "timed_out, shutdown", ["route", "outcome"],
                                registry=self.registry)
        self.abort_free_steps = Histogram("seqgate_abort_free_steps", "Engine steps from an "
                                          "abort request (client gone, deadline) to its batch "
                                          "slots being free", buckets=(0, 1, 2, 3, 5, 10, 100),
                                          registry=self.registry)
        self.sub_batches = Histogram("seqgate_step_sub_batches", "Sub-batches (forward calls) "
                                     "per decode step", buckets=(1, 2, 3, 4, 6, 8, 16),
                                     registry=self.registry)
        self.sparsity = Histogram("seqgate_step_sparsity", "Padding / real tokens per step after "
                                  "partitioning", buckets=(0, 0.01, 0.05, 0.1, 0.2, 0.33, 0.5, 1,
                                                           2, 5), registry=self.registry)
        self.step_seconds = Histogram("seqgate_step_seconds", "Wall time of one engine step",
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                                      registry=self.registry)
        self.ttft = Histogram("seqgate_time_to_first_token_seconds", "Request arrival to its "
                              "first generated token", buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                                1, 2.5, 5, 10, 30, 60),
                              registry=self.registry)
        self.tpot = Histogram("seqgate_time_per_output_token_seconds", "Mean time between "
                              "tokens after the first, per sequence", buckets=(0.005, 0.01, 0.025,
                                                                             0.05, 0.1, 0.25, 0.5,
                                                                             1, 2.5),
                              registry=self.registry)
        self.response_store_entries = Gauge("seqgate_response_store_entries", "Responses "
                                            "kept by the /v1/responses store",
                                            registry=self.registry)
        self.response_store_bytes = Gauge("seqgate_response_store_bytes", "Bytes of JSON held "
                                          "by the /v1/responses store (bounded by "
                                          "--response-store-bytes)", registry=self.registry)

    def report_response_store(self, entries: int, nbytes: int) -> None:
        self.response_store_entries.set(entries)
        self.response_store_bytes.set(nbytes)

    def attach(self, engine: EngineClient) -> None:
        self._engine = engine
        engine.add_step_listener(self.on_step)

    def on_step(self, stats: StepStats) -> None:  # engine thread
        for steps in stats.abort_free_steps:
            self.abort_free_steps.observe(steps)
        if stats.sub_batches:
            self.sub_batches.observe(stats.sub_batches)
            self.sparsity.observe(stats.sparsity)
        self.step_seconds.observe(stats.seconds)

    def count_outcome(self, route: str, outcome: str) -> None:
        self.outcomes.labels(route, outcome).inc()

    def count_response(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
