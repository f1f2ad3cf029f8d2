"""`greedy_tokens` picks what `torch.argmax` picks, row by row: the first largest column, or
the first NaN, whatever the chunk a tie or a NaN falls in."""

from __future__ import annotations

import pytest
import torch

from engine.sample.sampling import greedy_tokens


def _rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, vocab, generator=g).to(dtype)
    x[1, 5] = x[1, 700] = x[1].max() + 1  # a tie across chunks: the first wins
    x[2, 130] = x[2, 131] = x[2].max() + 1  # a tie within a chunk
    x[3, 900] = float("nan")  # a NaN beats every number
    x[4, 64] = x[4, 10] = float("nan")  # the first NaN, in an earlier chunk than the largest
    x[5] = float("-inf")  # nothing allowed: column 0, as argmax says
    x[6] = -1.0
    x[6, 5], x[6, 700] = -0.0, 0.0  # equal: the first column wins, -0.0 here
    x[7] = -1.0
    x[7, 70], x[7, 900] = 0.0, -0.0  # and 0.0 here
    x[8, -1] = x[8].max() + 1  # the last column
    x[9, :64] = float("-inf")  # a whole chunk hidden
    x[10, 0] = float("inf")
    x[11, 64 * 3 - 1] = x[11, 64 * 3] = float("inf")  # a tie at a chunk's edge
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1024, 49152, 1000])  # 1000: not whole chunks (argmax)
def test_greedy_tokens_equal_argmax(dtype, vocab):
    x = _rows(vocab, dtype)
    assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_of_views_and_no_rows(dtype):
    x = _rows(1024, dtype)
    for part in (x[3:6], x[[0, 3, 5]], x[11:]):  # views at an offset, a gathered copy
        assert torch.equal(greedy_tokens(part), part.argmax(dim=-1))
    strided = x[:, ::2]  # not contiguous: argmax itself
    assert torch.equal(greedy_tokens(strided), strided.argmax(dim=-1))
    assert greedy_tokens(x[:0]).shape == (0,)
    assert torch.equal(greedy_tokens(x[0]), x[0].argmax(dim=-1))  # one row, no batch
