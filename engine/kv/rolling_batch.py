"""The rolling batch: the running rows' KV as sub-batches, laid out anew when rows join or leave
(in place where a sub-batch can take the change, `SubBatch.can_take`)."""

from __future__ import annotations

from engine.kv.batch import RowOwner, SubBatch, build_sub_batch
from engine.kv.slabs import RowKV


class RollingBatch:
    """The running rows' KV, as sub-batches. Regrouped to a new partition when membership changes.
    """

    def __init__(self) -> None:
        self.sub_batches: list[SubBatch] = []

    def kv_bytes(self) -> int:
        return sum(sb.kv_bytes() for sb in self.sub_batches)

    def padded_tokens(self) -> int:
        return sum(sb.padded_tokens() for sb in self.sub_batches)

    def clear(self) -> None:
        """Drop every row (their jobs ended)."""
        self.sub_batches = []

    def regroup(self, groups: list[list[RowOwner]], new_rows: dict[RowOwner, RowKV]) -> None:
        """Lay the rows out as `groups`, editing a sub-batch in place where a group is its rows
        less some plus newly prefilled ones that fit (`SubBatch.can_take`), else building a fresh
        slab. Rows come from their current sub-batch or, newly prefilled, from `new_rows`. Rows
        in no group are dropped.
        """
        where: dict[RowOwner, tuple[SubBatch, int]] = {}
        for sb in self.sub_batches:
            for i, s in enumerate(sb.seqs):
                where[s] = (sb, i)

        def home(s: RowOwner) -> SubBatch | None:
            return where[s][0] if s in where else None

        edits: dict[int, SubBatch] = {}  # group index -> the sub-batch edited into it
        for gi, group in enumerate(groups):
            best, best_kept = None, 0
            for sb in self.sub_batches:
                if sb in edits.values():
                    continue
                kept = [s for s in group if home(s) is sb]
                joining = [s for s in group if home(s) is not sb]
                if len(kept) > best_kept and all(s in new_rows for s in joining) and \
                        sb.can_take(kept, [new_rows[s] for s in joining]):
                    best, best_kept = sb, len(kept)
            if best is not None:
                edits[gi] = best
        # Fresh slabs first: they read rows from sub-batches that the edits below rewrite.
        result: list[SubBatch | None] = [None] * len(groups)
        for gi, group in enumerate(groups):
            if gi not in edits:
                result[gi] = build_sub_batch(group, [new_rows[s] if s in new_rows else where[s]
                                                     for s in group])
        for gi, sb in edits.items():
            members = set(groups[gi])
            sb.drop({s for s in sb.seqs if s not in members})
            for s in groups[gi]:
                if home(s) is not sb:
                    sb.add(s, new_rows[s])
            result[gi] = sb
        self.sub_batches = result
