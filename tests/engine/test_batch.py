"""The rolling batch's slabs without a model: rows written into one block, grown in place."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from engine.kv.batch import build_sub_batch
from engine.kv.rolling_batch import RollingBatch
from engine.kv.slab_sizing import (
    CHARGED_RESERVED_COLUMNS,
    GROWTH_COLUMNS,
    MAX_RESERVED_COLUMNS,
    headroom,
    slab_columns,
)
from engine.kv.slabs import RowKV, new_slabs
from engine.model.decode_inputs import DecodeFeed
from engine.model.packed_forward import Group
from engine.request.job import Candidates, Job, Sequence
from engine.request.sampling_params import SamplingParams
from tests.engine.helpers import count_slab_columns

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
    # Room for the 4 tokens each row may still generate, and GROWTH_COLUMNS more.
    room = 4 + GROWTH_COLUMNS
    assert sb.cache.layers[0].capacity == 9 + room
    sb.reserve(9 + room)  # fits: nothing moves
    assert sb.cache.layers[0].kbuf.untyped_storage().data_ptr() in storages
    sb.reserve(9 + room + 1)  # full: every layer moves to one larger block
    assert sb.cache.layers[0].capacity == 9 + 2 * room + 1
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


def test_rows_leave_and_join_in_place():
    lengths = [9, 5, 7, 3, 8]
    rows = [row(n, i) for i, n in enumerate(lengths)]
    ss = seqs(lengths)
    batch = RollingBatch()
    batch.regroup([ss], dict(zip(ss, rows)))
    sb = batch.sub_batches[0]
    assert sb.row_capacity == 6  # a quarter more rows than it was built with
    storage = sb.cache.layers[0].kbuf.untyped_storage().data_ptr()
    # The 9-token row and the 3-token row leave: the window narrows to 8 columns.
    batch.regroup([[ss[1], ss[2], ss[4]]], {})
    assert batch.sub_batches == [sb] and sb.width == 8 and sb.size == 3
    # A new 9-token row and a new 4-token row join: the window widens back to 9 (the column
    # before it is free), the spare rows take them.
    extra = seqs([9, 4])
    new = {extra[0]: row(9, 7), extra[1]: row(4, 8)}
    batch.regroup([[ss[1], ss[2], ss[4], *extra]], new)
    assert batch.sub_batches == [sb] and sb.width == 9 and sb.size == 5
    assert sb.cache.layers[0].kbuf.untyped_storage().data_ptr() == storage  # nothing moved
    want = {ss[1]: rows[1], ss[2]: rows[2], ss[4]: rows[4], **new}
    for i, s in enumerate(sb.seqs):
        got = sb.row(i)
        for li in range(LAYERS):
            assert torch.equal(got.keys[li], want[s].keys[li])
            assert torch.equal(got.values[li], want[s].values[li])
    for layer in sb.cache.layers:  # padding is zeros, the window is what attention sees
        assert layer.keys.shape[0] == 5 and layer.keys.shape[2] == 9
        for i, s in enumerate(sb.seqs):
            assert torch.count_nonzero(layer.keys[i, :, : 9 - s.kv_len]) == 0
    # A row longer than the window's end cannot join in place: a fresh slab is built.
    longer = seqs([10])
    batch.regroup([[ss[1], *longer]], {longer[0]: row(10, 9)})
    assert batch.sub_batches[0] is not sb
    assert torch.equal(batch.sub_batches[0].row(0).keys[0], rows[1].keys[0])


def test_candidates_feed_as_a_tree_and_the_chosen_one_is_kept():
    """A greedy row feeds one token and a contrastive row three, at its next position; the
    contrastive queries see the row's context and their own new column only; after the write,
    the row keeps the chosen candidate's K/V as its newest column, read in place."""
    lengths = [4, 6]
    sb = build_sub_batch(seqs(lengths), [row(n, i) for i, n in enumerate(lengths)])
    greedy, contrastive = sb.seqs
    greedy.pending_token = 7
    contrastive.candidates = Candidates([11, 12, 13], torch.tensor([0.5, 0.3, 0.2]), None)
    feed = DecodeFeed.of(sb)
    assert feed.ids.tolist() == [7, 11, 12, 13] and feed.positions.tolist() == [4, 6, 6, 6]
    assert feed.first.tolist() == [0, 1] and feed.slots == 3
    allowed = feed.mask(torch.float32)[:, 0] == 0  # [rows, slots, width + slots]
    assert allowed[1].tolist() == [[True] * 6 + [True, False, False],
                                   [True] * 6 + [False, True, False],
                                   [True] * 6 + [False, False, True]]
    assert allowed[0, 0].tolist() == [False, False] + [True] * 4 + [True, False, False]
    # The packed layout round-trips through attention's [rows, heads, slots, dim].
    group = Group(sb.cache, 0, feed.tokens, sb.size, feed.mask(torch.float32), feed)
    packed = torch.arange(feed.tokens * HEADS * DIM, dtype=torch.float32).view(
        1, HEADS, feed.tokens, DIM)
    split = group.split(packed)
    assert split.shape == (2, HEADS, 3, DIM)
    assert torch.equal(split[1, :, 2], packed[0, :, 3]) and torch.equal(split[0, :, 0],
                                                                       packed[0, :, 0])
    joined = group.join(split.transpose(1, 2))  # attention returns [rows, q, heads, dim]
    assert torch.equal(joined, packed.transpose(1, 2))
    # The forward writes every fed column; the contrastive row keeps its third candidate.
    sb.reserve(sb.width + feed.slots)
    new = torch.randn(2, HEADS, 3, DIM)
    for layer in sb.cache.layers:
        layer.update(new, new * 2)
    sb.advance(feed.slots)
    sb.keep_slots([0, 2])
    for layer in sb.cache.layers:
        assert layer.end - layer.start == sb.width == 7
        assert torch.equal(layer.keys[0, :, -1], new[0, :, 0])
        assert torch.equal(layer.keys[1, :, -1], new[1, :, 2])
        assert torch.equal(layer.values[1, :, -1], 2 * new[1, :, 2])


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def _rows(lengths: list[int], max_new_tokens: int) -> list[Sequence]:
    job = Job("j", [1], SamplingParams(max_new_tokens=max_new_tokens), "greedy")
    out = [Sequence(job, i) for i in range(len(lengths))]
    for s, n in zip(out, lengths):
        s.kv_len = n
    return out


WIDE = 64  # a head dimension that makes the blocks below tens of MiB, past any huge page


def wide_row(length: int, seed: int) -> RowKV:
    g = torch.Generator().manual_seed(seed)
    return RowKV([torch.randn(HEADS, length, WIDE, generator=g) for _ in range(LAYERS)],
                 [torch.randn(HEADS, length, WIDE, generator=g) for _ in range(LAYERS)], length)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_slab_reserves_what_its_rows_may_generate_without_taking_the_memory():
    """On the CPU the columns for every token a row may still generate are reserved up front
    (bounded by MAX_RESERVED_COLUMNS), so decode steps never move the slab; pages never
    written are not resident, and kv_bytes counts the columns in use. On a device the
    reservation stops at CHARGED_RESERVED_COLUMNS (memory is taken at allocation)."""
    rows = _rows([300, 200], 4000)
    rows[1].generated = [7] * 1000  # 3,000 left for it, 4,000 for the first
    sources = [wide_row(300, 0), wide_row(200, 1)]
    before = _resident_bytes()
    sb = build_sub_batch(rows, sources)
    grown = _resident_bytes() - before
    layer = sb.cache.layers[0]
    assert layer.capacity == 300 + GROWTH_COLUMNS + 4000
    assert sb.kv_bytes() == LAYERS * 2 * 2 * HEADS * 300 * WIDE * 4  # 2 rows, to the end
    reserved = sum(b.nbytes for la in sb.cache.layers for b in (la.kbuf, la.vbuf))
    assert reserved > 16 * 2**20 and grown < reserved / 4
    storage = layer.kbuf.untyped_storage().data_ptr()
    sb.reserve(300 + 4000)  # the window after 4,000 decode steps: still in place
    assert sb.cache.layers[0].kbuf.untyped_storage().data_ptr() == storage
    many = Job("k", [1], SamplingParams(max_new_tokens=100_000), "greedy")
    assert headroom([Sequence(many, 0)], torch.device("cpu"), 300) == \
        GROWTH_COLUMNS + MAX_RESERVED_COLUMNS
    assert headroom(rows, torch.device("cuda"), 300) == GROWTH_COLUMNS + CHARGED_RESERVED_COLUMNS


def test_dead_columns_left_of_the_window_are_given_back():
    """When the longest rows leave, the columns left of the window are dead but resident; once
    they outnumber the window's, the next reserve moves the rows to a fresh block."""
    rows = _rows([900, 40, 30], 2000)
    sources = [row(900, 0), row(40, 1), row(30, 2)]
    sb = build_sub_batch(rows, sources)
    kept = [sb.row(i) for i in (1, 2)]
    sb.drop({rows[0]})
    assert sb.width == 40 and sb.cache.layers[0].start == 860
    storage = sb.cache.layers[0].kbuf.untyped_storage().data_ptr()
    sb.reserve(sb.width + 1)
    layer = sb.cache.layers[0]
    assert layer.kbuf.untyped_storage().data_ptr() != storage and layer.start == 0
    for i in range(2):
        got = sb.row(i)
        want = next(r for r, s in zip(kept, (rows[1], rows[2])) if s is sb.seqs[i])
        assert all(torch.equal(a, b) for a, b in zip(got.keys, want.keys))


def test_a_reservation_that_cannot_be_mapped_falls_back_to_a_charged_one(monkeypatch):
    """Under strict overcommit accounting a large reservation can fail to map: the slab is
    then made as on a device (whose memory is charged whole too), reserving up to
    CHARGED_RESERVED_COLUMNS and doubling, and with GROWTH_COLUMNS to spare when even that
    does not fit."""
    import engine.kv.slab_sizing as batch_module

    real = batch_module.new_slabs
    limit = [100]

    def strict(like, shapes):
        if shapes[0][0][2] > limit[0]:
            raise OSError(12, "Cannot allocate memory")
        return real(like, shapes)

    monkeypatch.setattr(batch_module, "new_slabs", strict)
    sb = build_sub_batch(_rows([9, 5], 3000), [row(9, 0), row(5, 1)])
    assert sb.cache.layers[0].capacity == 9 + GROWTH_COLUMNS
    limit[0] = 3000
    sb = build_sub_batch(_rows([9, 5], 3000), [row(9, 0), row(5, 1)])
    first = 9 + GROWTH_COLUMNS + CHARGED_RESERVED_COLUMNS
    assert sb.cache.layers[0].capacity == first
    sb.reserve(first + 1)  # full: the window's columns double
    assert sb.cache.layers[0].capacity == 2 * first


CHARGED, LAZY = False, True  # a device's blocks, the CPU's mapped ones


def test_on_a_device_a_slab_reserves_its_rows_budget_then_doubles():
    """The device policy as a function of (columns the window has, columns it needs, tokens its
    rows may still generate): the whole budget at once while it is at most
    CHARGED_RESERVED_COLUMNS, else that many and doubling when full, never past the budget."""
    # A fresh slab (no columns yet) whose rows may generate 256 tokens: all of them at once.
    assert slab_columns(0, 300, 256, CHARGED) == 300 + GROWTH_COLUMNS + 256
    # A budget past the cap: the cap now, then each move at least doubles the window's room.
    first = slab_columns(0, 300, 10_000, CHARGED)
    assert first == 300 + GROWTH_COLUMNS + CHARGED_RESERVED_COLUMNS
    second = slab_columns(first, first + 1, 10_000 - (first - 300), CHARGED)
    assert second == 2 * first
    assert slab_columns(second, second + 1, 10_000, CHARGED) == 4 * first
    # Doubling stops at what the rows may still write (and GROWTH_COLUMNS to spare).
    assert slab_columns(4000, 4001, 100, CHARGED) == 4001 + GROWTH_COLUMNS + 100
    assert slab_columns(4000, 4001, 0, CHARGED) == 4001 + GROWTH_COLUMNS
    assert slab_columns(4000, 4001, -3, CHARGED) == 4001 + GROWTH_COLUMNS  # rows past their limit
    # A move for dead columns (the window fits) keeps the window's room.
    assert slab_columns(2000, 40, 5000, CHARGED) == 2000


def test_on_the_cpu_a_slab_reserves_its_rows_budget_up_to_the_cap_and_never_doubles():
    """The CPU's reservation costs address space only, so it is made whole each time and its
    size does not depend on the slab's current one."""
    assert slab_columns(0, 300, 4000, LAZY) == 300 + GROWTH_COLUMNS + 4000
    assert slab_columns(0, 300, 100_000, LAZY) == 300 + GROWTH_COLUMNS + MAX_RESERVED_COLUMNS
    assert slab_columns(5000, 5001, 100_000, LAZY) == \
        5001 + GROWTH_COLUMNS + MAX_RESERVED_COLUMNS
    assert slab_columns(5000, 5001, -1, LAZY) == 5001 + GROWTH_COLUMNS


def test_decode_steps_on_a_device_move_the_slab_log_n_times(monkeypatch):
    """A slab under the device policy, grown one column per decode step as the runner does
    (`reserve` before each forward): 2,000 steps past the reservation move it a handful of
    times, each move at least doubling its columns (GROWTH_COLUMNS alone: every 64 steps)."""
    sizes = count_slab_columns(monkeypatch)
    steps = 2000 + CHARGED_RESERVED_COLUMNS
    rows = _rows([9, 5], steps)
    sb = build_sub_batch(rows, [row(9, 0), row(5, 1)])
    new = torch.zeros(2, HEADS, 1, DIM)
    for _ in range(steps):
        sb.reserve(sb.width + 1)
        for layer in sb.cache.layers:
            layer.update(new, new)
        sb.advance()
        sb.commit([0, 0])
        for s in rows:
            s.generated.append(0)
    # Built with the cap, doubled once, then the rest of the rows' budget: two moves.
    first = 9 + GROWTH_COLUMNS + CHARGED_RESERVED_COLUMNS
    assert sizes == [first, 2 * first, 9 + steps + 1 + GROWTH_COLUMNS]
    assert sb.width == 9 + steps
