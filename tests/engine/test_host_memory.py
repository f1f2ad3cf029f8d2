"""KV blocks in their own mappings: usable like any tensor, and returned to the kernel whole."""

from __future__ import annotations

import gc

import torch

from engine.kv.host_memory import MAPPED_MIN_BYTES, mapped_empty


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_blocks_are_tensors_and_their_memory_goes_back_when_freed():
    like = torch.empty(0, dtype=torch.bfloat16)
    shape = (30, 2, 3, 500, 64)  # SmolLM2's KV for 500 tokens: 11 MiB
    # glibc maps a block this large itself, at first; once one is freed, it serves blocks up to
    # that size from its heap, where small live tensors between them pin the freed space.
    del_me = like.new_empty(shape)
    del del_me
    before = rss_mib()
    blocks, pins = [], []
    for _ in range(40):
        blocks.append(mapped_empty(shape, like))
        pins.append(torch.empty(16 * 1024, dtype=torch.float32))  # 64 KiB each, kept
    for i, b in enumerate(blocks):
        b.fill_(i)
    assert blocks[7].shape == shape and blocks[7].dtype == torch.bfloat16
    assert blocks[7].is_contiguous() and float(blocks[7][3, 1, 2, 499, 63]) == 7.0
    assert rss_mib() - before > 300  # 440 MiB written
    view = blocks[5][2, 0]  # a view keeps its block
    del blocks
    gc.collect()
    assert bool((view == 5).all())
    assert rss_mib() - before < 40  # the other 39 blocks were unmapped
    del view
    small = mapped_empty((MAPPED_MIN_BYTES // 4,), torch.empty(0, dtype=torch.float16))
    assert small.numel() == MAPPED_MIN_BYTES // 4  # below the floor: an ordinary tensor
