"""lm-evaluation-harness against the live server: a small multiple-choice task read from a local
file, scored by the log-likelihood of each choice (`local-completions`: token ids, echo with
logprobs), gets the accuracy that lm-eval's own transformers model gets on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine import EngineConfig, load_model

pytestmark = pytest.mark.slow  # a live server and a second copy of the model

lm_eval = pytest.importorskip("lm_eval")
DATA = Path(__file__).with_name("lm_eval_capitals.jsonl")
TASK = "seqgate_capitals"


def _task_dir(tmp_path: Path) -> Path:
    task = {"task": TASK, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(DATA)}}, "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / f"{TASK}.yaml").write_text(yaml.safe_dump(task))
    return folder


def _evaluate(model, tasks) -> tuple[float, list[list[float]]]:
    """Accuracy and, per document, each choice's log-likelihood."""
    out = lm_eval.simple_evaluate(model=model, tasks=[TASK], log_samples=True, task_manager=tasks)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    scores = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return out["results"][TASK]["acc,none"], scores


def test_lm_eval_multiple_choice_matches_its_own_hf_model(live_server, tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # Our task alone: indexing lm-eval's thousands of built-in task files took seconds a run.
    tasks = TaskManager(include_path=str(_task_dir(tmp_path)), include_defaults=False)
    # lm-eval loads the tokenizer by path: the served one, saved (the embedded model's own
    # folder holds a GGUF, which a tokenizer alone does not load from).
    live_server.engine.tokenizer.save_pretrained(tmp_path / "tokenizer")
    served = LocalCompletionsAPI(
        base_url=live_server.base_url + "/completions", model=live_server.gateway.model_name,
        tokenizer_backend="huggingface", tokenized_requests=True,
        tokenizer=str(tmp_path / "tokenizer"), max_retries=1, num_concurrent=1)
    acc, scores = _evaluate(served, tasks)
    fresh = load_model(EngineConfig(dtype="fp32"))  # transformers' own layers, nothing installed
    own_acc, own_scores = _evaluate(HFLM(pretrained=fresh.model, tokenizer=fresh.tokenizer,
                                         batch_size=1), tasks)
    print(f"lm-eval {TASK}: acc {acc} through the server, {own_acc} through HFLM")
    assert acc == own_acc and acc > 0.5, (acc, own_acc)
    for ours, theirs in zip(scores, own_scores, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-3), json.dumps([ours, theirs])
