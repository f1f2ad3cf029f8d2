"""The structured-output benchmark's schemas and report, without a server."""

from __future__ import annotations

import json

import jsonschema

from bench.structured import ANSWER_MIN_CHARS, answer_schema, bodies, pooled, report


def test_schemas_force_full_length_answers_and_differ_by_suffix():
    a, b = answer_schema(), answer_schema("_1")
    assert a != b and set(b["properties"]) == {"title_1", "tags_1", "answer_1"}
    short = {"title": "t", "tags": ["code"], "answer": "x" * 100}
    assert not jsonschema.Draft202012Validator(a).is_valid(short)  # too short: never complete
    jsonschema.validate({**short, "answer": "x" * ANSWER_MIN_CHARS}, a)


def test_free_and_constrained_bodies_differ_only_in_the_constraint():
    messages = [[{"role": "user", "content": "hi"}]]
    free, constrained = bodies(messages, 32, False)[0], bodies(messages, 32, True)[0]
    assert free.pop("ignore_eos") is True
    assert constrained.pop("response_format")["type"] == "json_schema"
    assert free == constrained


def test_report_states_the_ratio_and_the_compile_cost():
    run = {"requests": 4, "failed": 0, "output_tokens": 400, "wall_s": 10.0,
           "ttft_p50_s": 0.5, "finish_reasons": {"length": 4}}
    data = {"meta": {"args": {"streams": 16}},
            "throughput": [{**run, "constrained": False, "output_tokens_per_s": 40.0,
                            "mask_us_per_token": None},
                           {**run, "constrained": True, "output_tokens_per_s": 36.0,
                            "mask_us_per_token": 120.5}],
            "new_schemas": {"fresh_ttft_s": [0.3, 0.2], "cached_ttft_s": [0.2, 0.2],
                            "fresh_ttft_p50_s": 0.25, "cached_ttft_p50_s": 0.2,
                            "added_by_compiling_p50_ms": 50.0,
                            "streams_worst_gap_over_median": 1.4,
                            "streams_median_gap_over_median": 1.2,
                            "cached_streams_worst_gap_over_median": 1.3,
                            "cached_streams_median_gap_over_median": 1.1}}
    text = report(json.loads(json.dumps(data)))
    assert "**0.900** (target >= 0.85: met)" in text
    assert "120.5 µs" in text and "compiling adds 50.0 ms" in text
    assert "worst stream 1.4×" in text and "cached: 1.3× and 1.1×" in text


def test_runs_of_a_kind_pool():
    runs = [{"constrained": True, "requests": 4, "failed": 0, "output_tokens": 400,
             "wall_s": 10.0, "finish_reasons": {"length": 4}, "ttft_p50_s": 0.5,
             "mask_us_per_token": 100.0},
            {"constrained": True, "requests": 4, "failed": 1, "output_tokens": 300,
             "wall_s": 5.0, "finish_reasons": {"length": 3, "None": 1}, "ttft_p50_s": 0.3,
             "mask_us_per_token": 120.0}]
    p = pooled(runs)
    assert (p["requests"], p["failed"], p["output_tokens"], p["wall_s"]) == (8, 1, 700, 15.0)
    assert p["output_tokens_per_s"] == round(700 / 15, 2)
    assert p["finish_reasons"] == {"length": 7, "None": 1}
    assert p["ttft_p50_s"] == 0.4 and p["mask_us_per_token"] == 110.0
