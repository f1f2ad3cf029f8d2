"""The GPU check (bench/gpu_check.py) cannot rot between GPU runs: its CPU dry run passes here,
offline, and its judges and wheel list are checked on their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from bench.gpu_check import GPU_IMAGE_HAS, ROOT, margin_report, needed_distributions


def test_cpu_dry_run_passes_offline(tmp_path):
    """`scripts/gpu_check.sh --device cpu --quick` with no package index: every section passes or
    says why it was skipped, and check.json holds them all."""
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--quick",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sections = json.loads((tmp_path / "check.json").read_text())["sections"]
    assert set(sections) >= {"env", "model", "parity", "half_precision", "features", "syncs",
                             "profile", "throughput", "http", "memory", "tests"}
    assert all(r.get("ok") is not False for r in sections.values())
    assert sections["parity"]["violations"] == 0 and sections["parity"]["positions"] > 0
    assert sections["parity"]["max_sub_batches"] > 1
    assert sections["parity"]["cached_prompt_tokens"] > 0
    assert sections["features"]["grammar_valid_json"]
    assert sections["throughput"]["rows_4"]["tokens"] == 32
    assert sections["http"]["stream_chunks"] > 1
    memory = sections["memory"]
    assert memory["outputs_equal_unbudgeted"] and memory["peak_kv_mib"] <= memory["batch_limit_mib"]


def test_margin_rule_tells_near_ties_from_wrong_tokens(tiny_model):
    model = tiny_model.model
    prompt = tiny_model.tokenizer.encode("The river ran past the mill")
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    greedy = out[0, len(prompt):].tolist()
    assert margin_report(model, prompt, greedy)["violations"] == 0
    assert margin_report(model, prompt, greedy)["exact"] == 6
    with torch.inference_mode():
        logp = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    worst = int(logp.argmin())  # far below the argmax: no near-tie
    report = margin_report(model, prompt, [worst] + greedy[1:])
    assert report["violations"] >= 1 and report["worst_gap"] > 1


def test_carried_wheels_are_what_the_gpu_image_lacks():
    dists = needed_distributions()
    assert {"litestar", "msgspec", "llguidance", "uvicorn", "openai", "pydantic"} <= set(dists)
    assert not set(dists) & GPU_IMAGE_HAS
    assert "torch" not in dists and "transformers" not in dists
