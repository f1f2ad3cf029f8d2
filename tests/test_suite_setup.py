"""How the suite itself runs."""

import os

import torch


def test_the_suite_runs_on_the_cpu(request):
    """Pinned by tests/conftest.py, so that a machine with a GPU runs the same suite; only a run
    that selects the `gpu` tests sees it."""
    if "gpu" in (request.config.option.markexpr or "").replace("not gpu", ""):
        return
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert not torch.cuda.is_available()
