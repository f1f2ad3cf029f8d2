"""`seqgate serve --replicas 2` on a local Ray: routing, prefix affinity, streams, disconnects,
a killed replica. One Ray instance and one gateway per router policy for the whole module."""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
import ray

from bench.workloads import PROMPT_WORDS, distinct_system_prompts

pytestmark = pytest.mark.slow

SYSTEM_PROMPT_TOKENS = 400
PROMPTS, PER_PROMPT = 4, 16
FIGURES: dict[str, dict] = {}  # per policy, for the comparison at the end


@pytest.fixture(scope="module")
def affinity(start_gateway):
    return start_gateway("--router", "prefix_affinity")


def prompts(tiny_model, seed: int) -> list[str]:
    return distinct_system_prompts(tiny_model.tokenizer, PROMPTS, SYSTEM_PROMPT_TOKENS, seed)


@dataclass
class Answer:
    prompt: int
    replica: str
    prompt_tokens: int
    cached_tokens: int


def ask(client, system: str, k: int, i: int) -> Answer:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system},
                  {"role": "user", "content": f"Question {i}."}])
    reply = raw.parse()
    details = reply.usage.prompt_tokens_details
    return Answer(k, raw.headers["x-seqgate-replica"], reply.usage.prompt_tokens,
                  details.cached_tokens if details else 0)


def shared_prompt_workload(gateway, prompts: list[str]) -> list[Answer]:
    """Each prompt's first request (the four at once), then the other 60 in a shuffled order
    (the same for every policy), 8 at a time, as clients sharing system prompts would send them.
    Shuffled, not in turn: with 4 prompts taking turns, round-robin over 2 replicas would send
    each prompt's requests to one replica, unless the threads happened to reorder them."""
    client = gateway.client()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda k: ask(client, prompts[k], k, 0), range(PROMPTS)))
        rest = [(k, i) for i in range(1, PER_PROMPT) for k in range(PROMPTS)]
        random.Random(0).shuffle(rest)
        answers += pool.map(lambda ki: ask(client, prompts[ki[0]], *ki), rest)
    return answers


def summarize(answers: list[Answer]) -> dict:
    by_prompt = defaultdict(set)
    for a in answers:
        by_prompt[a.prompt].add(a.replica)
    return {
        "cached_fraction": sum(a.cached_tokens for a in answers) /
                           sum(a.prompt_tokens for a in answers),
        "replicas_per_prompt": {k: sorted(v) for k, v in sorted(by_prompt.items())},
        "replicas_used": sorted({a.replica for a in answers}),
    }


def test_requests_spread_over_both_replicas(affinity):
    client = affinity.client()
    with ThreadPoolExecutor(8) as pool:
        replicas = list(pool.map(
            lambda i: client.completions.with_raw_response.create(
                model="tiny", prompt=f"Prompt {i}: {' '.join(PROMPT_WORDS[i:i + 8])}",
                max_tokens=8).headers["x-seqgate-replica"], range(8)))
    assert set(replicas) == set(affinity.replicas()) and len(set(replicas)) == 2
    health = affinity.health()
    assert health["status"] == "ok" and len(health["replicas"]) == 2
    metrics = httpx.get(affinity.url + "/metrics").text
    for rid in set(replicas):  # per-replica series, labelled
        routed = re.search(rf'seqgate_replica_routed_requests_total{{replica="{rid}"}} (\S+)',
                           metrics)
        assert routed and float(routed.group(1)) >= replicas.count(rid), metrics[-2000:]
        assert f'seqgate_replica_up{{replica="{rid}"}} 1.0' in metrics


def test_a_stream_goes_through_the_router(affinity):
    chunks = list(affinity.client().chat.completions.create(
        model="tiny", max_tokens=12, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Stream me something."}]))
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].delta.content or "") for c in chunks if c.choices) > 0


def settled_reports(gateway, timeout: float = 15) -> dict[str, dict]:
    """The replicas' reports once two reads a second apart agree (they lag by up to ~1 s)."""
    deadline = time.monotonic() + timeout
    last = gateway.replicas()
    while time.monotonic() < deadline:
        time.sleep(1)
        now = gateway.replicas()
        if now == last:
            return now
        last = now
    raise AssertionError(f"the replicas' reports kept changing: {last}")


def test_a_disconnected_stream_is_aborted_on_its_replica(affinity):
    reports = settled_reports(affinity)
    body = {"model": "tiny", "max_tokens": 1800, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "A long story, please."}]}
    with httpx.stream("POST", affinity.url + "/v1/chat/completions", json=body,
                      timeout=60) as response:
        replica = response.headers["x-seqgate-replica"]
        before = reports[replica].get("finished", {})
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        report = affinity.replicas()[replica]
        finished = report.get("finished", {})
        if finished.get("abort", 0) > before.get("abort", 0) and report["running"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"replica {replica} never aborted the job: {report}")
    assert finished.get("length", 0) == before.get("length", 0), "the job ran to its end"


def test_each_system_prompt_stays_on_one_replica_under_prefix_affinity(affinity, tiny_model):
    answers = shared_prompt_workload(affinity, prompts(tiny_model, seed=1))
    figures = FIGURES["prefix_affinity"] = summarize(answers)
    print("prefix_affinity:", json.dumps(figures))
    assert all(len(r) == 1 for r in figures["replicas_per_prompt"].values()), figures
    assert len(figures["replicas_used"]) == 2, figures
    assert figures["cached_fraction"] >= 0.9, figures


def test_a_killed_replica_is_restarted_and_the_endpoint_keeps_answering(affinity):
    before = set(affinity.replicas())
    victim = sorted(before)[0]
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::seqgate#engine#")
                and a["name"].endswith(victim))
    body = {"model": "tiny", "max_tokens": 1800, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Keep going."}]}
    streams = []
    with httpx.Client(timeout=60) as http:
        for _ in range(4):  # least-loaded spreads them: some land on the victim
            r = http.send(http.build_request("POST", affinity.url + "/v1/chat/completions",
                                             json=body), stream=True)
            streams.append(r)
        on_victim = [r for r in streams if r.headers["x-seqgate-replica"] == victim]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        for r in on_victim:  # ends with an error event naming the replica; never hangs
            text = "".join(r.iter_text())
            assert "replica" in text and text.rstrip().endswith("data: [DONE]"), text[-500:]
        for r in streams:
            r.close()

    client = affinity.client(max_retries=5)
    deadline = time.monotonic() + 90
    answered = 0
    while time.monotonic() < deadline:
        reply = client.completions.create(model="tiny", prompt="Still there?", max_tokens=4)
        answered += reply.usage.completion_tokens == 4
        now = set(affinity.replicas())
        if len(now) == 2 and victim not in now and answered >= 3:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no restarted replica after 90 s: {affinity.replicas()}")
    assert affinity.health()["status"] == "ok"


def test_sigterm_drains_a_running_stream_then_exits_0(affinity):
    body = {"model": "tiny", "max_tokens": 600, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me everything."}]}
    with httpx.stream("POST", affinity.url + "/v1/chat/completions", json=body,
                      timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        affinity.proc.send_signal(signal.SIGTERM)
        after = [line for line in lines if line.startswith("data: ")]
    assert len(after) > 2, "the stream had ended before SIGTERM: nothing was drained"
    assert after[-1] == "data: [DONE]"
    assert json.loads(after[-2][6:])["choices"][0]["finish_reason"] == "length", after[-2]
    assert affinity.proc.wait(timeout=60) == 0, "".join(affinity.output[-30:])


def test_round_robin_caches_less_than_prefix_affinity(start_gateway, affinity, tiny_model):
    """The same workload, with new prompts, through a gateway routing round-robin (it redeploys
    the replicas, so their caches start empty)."""
    if affinity.proc.poll() is None:
        assert affinity.stop() == 0
    rr = start_gateway("--router", "round_robin")
    answers = shared_prompt_workload(rr, prompts(tiny_model, seed=2))
    figures = FIGURES["round_robin"] = summarize(answers)
    print("round_robin:", json.dumps(figures))
    assert all(len(r) == 2 for r in figures["replicas_per_prompt"].values()), figures
    assert "prefix_affinity" in FIGURES, "run the whole module: the affinity figures come first"
    assert figures["cached_fraction"] < FIGURES["prefix_affinity"]["cached_fraction"], FIGURES
    # Stopped here: the next gateway's deployment would otherwise replace these replicas one at
    # a time (Ray Serve's rolling update) instead of starting its own two together.
    assert rr.stop() == 0


def test_429_only_once_every_replica_queue_is_full(start_gateway, affinity):
    """Each replica holds one running and one queued job here: four long streams are taken
    (least-loaded puts two on each replica), the next ones are refused with 429."""
    if affinity.proc.poll() is None:
        affinity.stop()
    small = start_gateway("--router", "least_loaded", "--max-rolling-batch-size", "1",
                          "--job-queue-size", "1")
    body = {"model": "tiny", "max_tokens": 1800, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Go on and on."}]}
    with httpx.Client(timeout=60) as http:
        responses = [http.send(http.build_request("POST", small.url + "/v1/chat/completions",
                                                  json=body), stream=True) for _ in range(6)]
        try:
            statuses = [r.status_code for r in responses]
            taken = [r.headers["x-seqgate-replica"] for r in responses if r.status_code == 200]
            refused = [r for r in responses if r.status_code == 429]
            assert statuses.count(200) == 4 and len(refused) == 2, statuses
            assert sorted(taken.count(rid) for rid in set(taken)) == [2, 2], taken
            refused[0].read()
            assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
            assert "retry-after" in refused[0].headers
        finally:
            for r in responses:
                r.close()
