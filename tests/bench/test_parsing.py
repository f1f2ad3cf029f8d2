"""The benchmark's parsers: SSE chunks of both servers, /metrics deltas, text comparison and the
cut-short ShareGPT file."""

from __future__ import annotations

import json

from bench.agreement import first_difference
from bench.figures import RequestResult
from bench.loadgen import apply_chunk
from bench.scrape import histogram_delta, parse


def _chunk(**fields) -> str:
    return json.dumps({"object": "chat.completion.chunk", **fields})


def test_role_only_chunk_is_not_the_first_token():
    res = RequestResult(0, sent=0.0)
    role = _chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    assert not apply_chunk(res, role, 1.0, keep_text=True)
    assert res.first_token is None
    assert not apply_chunk(res, _chunk(choices=[{"delta": {"content": "Hi"}}]), 2.0, True)
    assert not apply_chunk(res, _chunk(choices=[{"delta": {"content": "!"},
                                                 "finish_reason": "stop"}]), 3.0, True)
    usage = {"completion_tokens": 2, "prompt_tokens": 9,
             "prompt_tokens_details": {"cached_tokens": 4}}
    assert not apply_chunk(res, _chunk(choices=[], usage=usage), 3.1, True)
    assert apply_chunk(res, "[DONE]", 3.2, True)
    assert (res.first_token, res.text, res.finish_reason) == (2.0, "Hi!", "stop")
    assert (res.output_tokens, res.prompt_tokens, res.cached_tokens) == (2, 9, 4)


def test_completion_chunks_and_stream_errors():
    res = RequestResult(0, sent=0.0)
    apply_chunk(res, json.dumps({"choices": [{"index": 0, "text": "abc"}]}), 1.0, False)
    assert res.first_token == 1.0 and res.text == "" and res.content_chunks == 1
    # transformers serve sends a bare string, seqgate an OpenAI error object
    assert apply_chunk(res, '{"error": "CB worker died"}', 2.0, False)
    assert res.error == "stream error: CB worker died"
    other = RequestResult(1, sent=0.0)
    assert apply_chunk(other, json.dumps({"error": {"message": "too long", "code": "x"}}), 1, 0)
    assert other.error == "stream error: too long"


METRICS = """\
# TYPE seqgate_step_sub_batches histogram
seqgate_step_sub_batches_bucket{{le="1.0"}} {b1}
seqgate_step_sub_batches_bucket{{le="2.0"}} {b2}
seqgate_step_sub_batches_bucket{{le="3.0"}} {n}
seqgate_step_sub_batches_bucket{{le="+Inf"}} {n}
seqgate_step_sub_batches_count {n}
seqgate_step_sub_batches_sum {s}
# TYPE seqgate_engine_steps counter
seqgate_engine_steps_total {n}
"""


def test_histogram_delta_covers_only_the_run():
    before = parse(METRICS.format(b1=4, b2=4, n=4, s=4))
    after = parse(METRICS.format(b1=6, b2=9, n=10, s=19))
    assert after["seqgate_engine_steps_total"] == 10
    h = histogram_delta(before, after, "seqgate_step_sub_batches")
    assert (h["count"], h["sum"], h["mean"], h["max_le"]) == (6, 15, 2.5, 3.0)
    assert h["buckets"]["1.0"] == 2
    assert histogram_delta(before, before, "seqgate_step_sub_batches")["mean"] is None


def test_first_difference():
    assert first_difference("abc", "abc") is None
    assert first_difference("abc", "abd") == 2
    assert first_difference("ab", "abc") == 2
    assert first_difference([1, 2], [0]) == 0


def test_sharegpt_parser_stops_at_the_broken_tail():
    from bench.sharegpt import iter_complete

    text = '[{"id": 1}, {"id": 2} ,\n {"id": 3, "conversations": [{"from": "hu'
    assert [c["id"] for c in iter_complete(text)] == [1, 2]
    assert list(iter_complete("[]")) == []


def test_margins_compare_the_choice_with_the_best_other_token():
    from bench.loadgen import _margins

    tie = {"token": " I", "logprob": -2.0, "bytes": [32, 73], "top_logprobs": [
        {"token": " What", "logprob": -2.0, "bytes": [32, 87, 104, 97, 116]},
        {"token": " I", "logprob": -2.0, "bytes": [32, 73]}]}
    clear = {"token": "A", "logprob": -0.1, "top_logprobs": [
        {"token": "A", "logprob": -0.1}, {"token": "B", "logprob": -2.6}]}
    assert _margins({"logprobs": {"content": [tie, clear]}}) == [(" I", " What", 0.0),
                                                                  ("A", "B", 2.5)]
    assert _margins({"logprobs": None}) is None


def test_saved_results_carry_no_machine_paths():
    from pathlib import Path

    from bench.serving import portable

    repo = Path(__file__).resolve().parent.parent.parent
    text = json.dumps({"out": f"{repo}/bench/results/x.json", "cwd": str(repo),
                       "model": f"{Path.home()}/.cache/seqgate/m", "other": "/opt/x"})
    assert json.loads(portable(text)) == {"out": "./bench/results/x.json", "cwd": ".",
                                          "model": "~/.cache/seqgate/m", "other": "/opt/x"}
