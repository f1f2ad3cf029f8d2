"""The prefix cache: a radix tree over prompt token ids whose edges hold their tokens' KV.

RadixAttention's idea (SGLang) on our slab engine: every prefilled prompt is inserted, and a new
prompt reuses the longest cached prefix of its token ids, whoever computed it: the system prompt
and earlier turns of a conversation, or the shared head of two system prompts. Requests that
share a head share the nodes that hold it. Least recently used leaves are evicted first when the
tree holds more than `capacity_bytes`; an inner node becomes a leaf (and evictable) once its
children are gone.

The tree lives on the engine thread (lookups and inserts happen in prefill); other threads only
read its counters. Entries handed out are fresh tensors (concatenated along the path), never
views of a node, so a node can be split or evicted while a job still uses what it matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.kv.slabs import new_slabs


@dataclass
class PrefixEntry:
    """The KV (and, for contrastive search, last-layer hidden states) of one prompt prefix."""

    keys: list[torch.Tensor]  # per layer [heads, length, dim]
    values: list[torch.Tensor]
    hidden: torch.Tensor | None  # [length, hidden] or None when not computed
    length: int

    @property
    def nbytes(self) -> int:
        n = sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)
        return n + (self.hidden.nbytes if self.hidden is not None else 0)


@dataclass(eq=False)
class _Node:
    """One edge of the tree: its tokens and their KV; children keyed by their first token."""

    tokens: tuple[int, ...]
    kv: PrefixEntry | None  # None only at the root
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens `a` and `b` share (at most `limit`)."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    if list(a[:n]) == list(b[:n]):  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _gather(parts: list[tuple[PrefixEntry, int, int]], hidden: bool) -> PrefixEntry:
    """Positions [start, stop) of each part, concatenated, as fresh tensors that share no storage
    with the parts. Every layer's keys and values go in one block when their shapes agree (the
    usual case; `engine.kv.batch.new_slabs`): a node's KV is then one allocation, made and freed
    whole, in a mapping of its own from 1 MiB up (engine.kv.host_memory). Sixty tensors of a few
    KiB each per node, living as long as the node, fragmented the heap as the tree's entries
    were evicted and replaced under load, and resident memory crept up (docs/reliability.md)."""
    first = parts[0][0]
    length = sum(stop - start for _, start, stop in parts)
    slabs = new_slabs(first.keys[0], [((k.shape[0], length, k.shape[-1]),
                                       (v.shape[0], length, v.shape[-1]))
                                      for k, v in zip(first.keys, first.values, strict=True)])
    at = 0
    for kv, start, stop in parts:
        n = stop - start
        for (k_out, v_out), k, v in zip(slabs, kv.keys, kv.values, strict=True):
            k_out[:, at:at + n] = k[:, start:stop]
            v_out[:, at:at + n] = v[:, start:stop]
        at += n
    return PrefixEntry([k for k, _ in slabs], [v for _, v in slabs],
                       torch.cat([kv.hidden[a:b] for kv, a, b in parts]) if hidden else None,
                       length)


def _slice(kv: PrefixEntry, start: int, stop: int) -> PrefixEntry:
    """Own copies of positions [start, stop): a node never shares storage with another."""
    return _gather([(kv, start, stop)], kv.hidden is not None)


class RadixPrefixCache:
    """Longest-prefix reuse of prompt KV, bounded in bytes, evicting least recently used leaves.

    Counters (read by /metrics): `hits` and `misses` per lookup, `reused_tokens` in total,
    `evictions` (nodes), `nbytes` and `len()` (nodes holding KV).
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._root = _Node((), None, None)
        self._bytes = 0
        self._nodes = 0
        self._clock = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return self._nodes

    def clear(self) -> None:
        """Drop every entry (the counters of hits, misses and evictions stay)."""
        self._root = _Node((), None, None)
        self._bytes = self._nodes = 0

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        node.last_used = self._clock

    def match(self, ids: list[int], limit: int, need_hidden: bool = False,
              min_tokens: int = 1) -> PrefixEntry | None:
        """The KV of the longest cached prefix of `ids[:limit]` (with hidden states on every
        position when `need_hidden`), or None when it is shorter than `min_tokens`."""
        path: list[tuple[_Node, int]] = []
        node, matched = self._root, 0
        while matched < limit:
            child = node.children.get(ids[matched])
            if child is None or (need_hidden and child.kv.hidden is None):
                break
            n = common_prefix(child.tokens, ids[matched:limit])
            path.append((child, n))
            matched += n
            if n < len(child.tokens):
                break
            node = child
        if matched < max(min_tokens, 1):
            self.misses += 1
            return None
        for child, _ in path:
            self._touch(child)
        self.hits += 1
        self.reused_tokens += matched
        return _gather([(child.kv, 0, n) for child, n in path], need_hidden)

    def insert(self, ids: list[int], kv: PrefixEntry) -> None:
        """Cache `ids` with their KV (`kv` covers at least len(ids) positions; its hidden states,
        when present, fill nodes that lack them). Only what is not cached yet is copied."""
        if not ids or kv.nbytes * len(ids) // max(kv.length, 1) > self.capacity_bytes:
            return
        node, i = self._root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                leaf = _Node(tuple(ids[i:]), _slice(kv, i, len(ids)), node)
                node.children[ids[i]] = leaf
                self._bytes += leaf.nbytes
                self._nodes += 1
                self._touch(leaf)
                break
            n = common_prefix(child.tokens, ids[i:])
            if n < len(child.tokens):
                child = self._split(child, n)
            if kv.hidden is not None and child.kv.hidden is None:
                child.kv.hidden = kv.hidden[i:i + n].clone()
                self._bytes += child.kv.hidden.nbytes
            self._touch(child)
            node, i = child, i + n
        self._evict()

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node`'s edge after `n` tokens; returns the new upper part (its tail stays a child
        of it)."""
        parent = node.parent
        upper = _Node(node.tokens[:n], _slice(node.kv, 0, n), parent,
                      last_used=node.last_used)
        lower_kv = _slice(node.kv, n, len(node.tokens))
        self._bytes += upper.nbytes + lower_kv.nbytes - node.nbytes
        self._nodes += 1
        parent.children[node.tokens[0]] = upper
        node.tokens, node.kv, node.parent = node.tokens[n:], lower_kv, upper
        upper.children[node.tokens[0]] = node
        return upper

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                out.append(node)
        return out

    def _evict(self) -> None:
        if self._bytes <= self.capacity_bytes:
            return
        leaves = sorted(self._leaves(), key=lambda n: n.last_used)
        while self._bytes > self.capacity_bytes and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self._bytes -= leaf.nbytes
            self._nodes -= 1
            self.evictions += 1
            if parent is not self._root and not parent.children:
                # Its parent is a leaf now: it goes in line by its own last use.
                at = next((j for j, x in enumerate(leaves) if x.last_used > parent.last_used),
                          len(leaves))
                leaves.insert(at, parent)

    def check_integrity(self) -> None:
        """Assert the byte and node counts match the tree, every edge's KV has its length, and
        the tree is within capacity (the engine runs it when it goes idle, on its own thread,
        the only one that touches the cache)."""
        total, nodes, stack = 0, 0, [self._root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node and child.tokens and child.tokens[0] == first
                assert child.kv.length == len(child.tokens)
                assert all(k.shape[-2] == child.kv.length for k in child.kv.keys)
                if child.kv.hidden is not None:
                    assert child.kv.hidden.shape[0] == child.kv.length
                total += child.nbytes
                nodes += 1
                stack.append(child)
        assert total == self._bytes, f"the cache counts {self._bytes} bytes, nodes hold {total}"
        assert nodes == self._nodes, f"the cache counts {self._nodes} nodes, the tree {nodes}"
        assert self._bytes <= self.capacity_bytes, "prefix cache over capacity"
