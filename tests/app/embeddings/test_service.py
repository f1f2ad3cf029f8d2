"""app/embeddings/service.py without a model: how rows are cut into forwards, and a thread's
torch thread count that leaves the others' alone."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from app.embeddings.service import (
    EmbeddingQueueFull,
    EmbeddingService,
    EmbeddingStopped,
    pin_torch_threads,
    plan_forwards,
)


def test_rows_are_sorted_by_length_and_cut_at_the_token_budget():
    assert plan_forwards([5, 1, 3, 2], 100) == [[1, 3, 2, 0]]
    # 3 rows of 2 fit in 6 padded tokens; the row of 3 would make it 4 × 3 = 12.
    assert plan_forwards([3, 2, 2, 2], 6) == [[1, 2, 3], [0]]
    assert plan_forwards([50, 10], 20) == [[1], [0]]  # a row over the budget runs alone
    assert plan_forwards([], 10) == []


@given(st.lists(st.integers(1, 64), max_size=40), st.integers(1, 256))
def test_every_row_runs_once_within_the_budget(lengths, budget):
    forwards = plan_forwards(lengths, budget)
    assert sorted(i for f in forwards for i in f) == list(range(len(lengths)))
    for f in forwards:
        assert len(f) == 1 or len(f) * max(lengths[i] for i in f) <= budget


def test_a_full_queue_refuses_yet_a_large_request_alone_is_taken():
    service = EmbeddingService(model=None, max_queued_tokens=4)  # never started: rows wait
    service.submit([[1] * 10])  # over the limit, but nothing waits before it
    with pytest.raises(EmbeddingQueueFull, match="10 tokens are waiting"):
        service.submit([[1]])
    service.stop()


def test_a_stopped_service_fails_what_waits_and_refuses_more():
    service = EmbeddingService(model=None)
    waiting = service.submit([[1, 2]])
    service.stop()
    with pytest.raises(EmbeddingStopped):
        waiting.result(timeout=5)
    with pytest.raises(EmbeddingStopped):
        service.submit([[1]])


def test_pinning_leaves_the_engine_threads_count_alone():
    """An engine thread that set its count but has not run an op yet keeps it, and threads
    started later get the process-wide count, not the embedding thread's."""
    engine_set, pinned = threading.Event(), threading.Event()
    seen: dict[str, int] = {}
    before = torch.get_num_threads()

    def engine() -> None:
        torch.set_num_threads(2)
        engine_set.set()
        pinned.wait()
        seen["engine"] = torch.get_num_threads()

    def embedder() -> None:
        engine_set.wait()
        pin_torch_threads(1)
        pinned.set()
        seen["embedder"] = torch.get_num_threads()

    threads = [threading.Thread(target=engine), threading.Thread(target=embedder)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        later = threading.Thread(target=lambda: seen.setdefault("later", torch.get_num_threads()))
        later.start()
        later.join()
    finally:
        torch.set_num_threads(before)
    assert seen == {"engine": 2, "embedder": 1, "later": 2}
