"""The rolling batch's slabs without a model: rows written into one block, grown in place."""

from __future__ import annotations

import torch

from engine.batch import GROWTH_COLUMNS, RowKV, build_sub_batch, new_slabs
from engine.job import Job, Sequence
from engine.sampling_params import SamplingParams

LAYERS, HEADS, DIM = 3, 2, 4


def row(length: int, seed: int) -> RowKV:
    g = torch.Generator().manual_seed(seed)
    return RowKV([torch.randn(HEADS, length, DIM, generator=g) for _ in range(LAYERS)],
                 [torch.randn(HEADS, length, DIM, generator=g) for _ in range(LAYERS)], length)


def seqs(lengths: list[int]) -> list[Sequence]:
    job = Job("j", [1], SamplingParams(max_new_tokens=4), "greedy")
    out = [Sequence(job, i) for i in range(len(lengths))]
    for s, n in zip(out, lengths):
        s.kv_len = n
    return out


def test_one_block_holds_every_layer_and_rows_survive_growth():
    lengths = [5, 9, 2]
    rows = [row(n, i) for i, n in enumerate(lengths)]
    sb = build_sub_batch(seqs(lengths), rows)
    storages = {layer.kbuf.untyped_storage().data_ptr() for layer in sb.cache.layers}
    storages |= {layer.vbuf.untyped_storage().data_ptr() for layer in sb.cache.layers}
    assert len(storages) == 1  # one allocation for the sub-batch
    assert sb.cache.layers[0].capacity == 9 + GROWTH_COLUMNS
    sb.reserve(9 + GROWTH_COLUMNS)  # fits: nothing moves
    assert sb.cache.layers[0].kbuf.untyped_storage().data_ptr() in storages
    sb.reserve(9 + GROWTH_COLUMNS + 1)  # full: every layer moves to one larger block
    assert sb.cache.layers[0].capacity == 9 + 2 * GROWTH_COLUMNS + 1
    assert len({layer.kbuf.untyped_storage().data_ptr() for layer in sb.cache.layers}) == 1
    for i, r in enumerate(rows):
        got = sb.row(i)
        for li in range(LAYERS):
            assert torch.equal(got.keys[li], r.keys[li]) and torch.equal(got.values[li],
                                                                         r.values[li])
    # Left padding is zeros (finite), so masked scores never multiply garbage.
    assert torch.count_nonzero(sb.cache.layers[1].kbuf[2, :, : 9 - 2]) == 0


def test_layers_of_different_shapes_get_their_own_buffers():
    like = torch.empty(0)
    mixed = new_slabs(like, [((1, 2, 8, 4), (1, 2, 8, 4)), ((1, 1, 8, 4), (1, 1, 8, 4))])
    assert [k.shape[1] for k, _ in mixed] == [2, 1]
    uneven = new_slabs(like, [((1, 2, 8, 4), (1, 2, 8, 6))])  # value dim differs from key dim
    assert uneven[0][0].shape[-1] == 4 and uneven[0][1].shape[-1] == 6
