"""seqgate's /metrics, scraped before and after a run: what the engine did during it.

The engine exposes per-step histograms (`seqgate_step_sub_batches`, `seqgate_step_sparsity`,
observed once per decode step) and counters (steps, prompt-cache hits, cached tokens, generated
tokens). The difference of two scrapes covers exactly the run between them.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, float]  # "name{label=value,...}" -> value


def parse(text: str) -> Samples:
    """Prometheus text exposition → flat samples (names as exposed, labels sorted)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def scrape(base_url: str) -> Samples:
    resp = httpx.get(base_url + "/metrics", timeout=30.0)
    resp.raise_for_status()
    return parse(resp.text)


def delta(before: Samples, after: Samples, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def histogram_delta(before: Samples, after: Samples, name: str) -> dict:
    """count, sum, mean and the cumulative buckets of a histogram between two scrapes, plus
    `max_le`: the smallest bucket bound that holds every observation (an upper bound on the max)."""
    count = delta(before, after, f"{name}_count")
    total = delta(before, after, f"{name}_sum")
    prefix = f"{name}_bucket{{le="
    buckets = {}
    for key in after:
        if key.startswith(prefix):
            buckets[key[len(prefix):-1]] = delta(before, after, key)
    bounded = sorted((float(le), n) for le, n in buckets.items() if le != "+Inf")
    max_le = next((le for le, n in bounded if n >= count), None) if count else None
    return {"count": count, "sum": total, "mean": total / count if count else None,
            "buckets": buckets, "max_le": max_le}


def engine_activity(before: Samples, after: Samples) -> dict:
    """What seqgate's engine did between two scrapes."""
    return {
        "steps": delta(before, after, "seqgate_engine_steps_total"),
        "generated_tokens": delta(before, after, "seqgate_generated_tokens_total"),
        "prompt_tokens": delta(before, after, "seqgate_prompt_tokens_total"),
        "prompt_cache_hits": delta(before, after, "seqgate_prompt_cache_hits_total"),
        "prompt_cache_cached_tokens": delta(before, after,
                                            "seqgate_prompt_cache_cached_tokens_total"),
        "spec_proposed_tokens": delta(before, after, "seqgate_spec_proposed_tokens_total"),
        "spec_accepted_tokens": delta(before, after, "seqgate_spec_accepted_tokens_total"),
        "sub_batches_per_step": histogram_delta(before, after, "seqgate_step_sub_batches"),
        "sparsity_per_step": histogram_delta(before, after, "seqgate_step_sparsity"),
        "kv_gauges": {k: v for k, v in after.items() if "kv" in k.lower()},
    }
