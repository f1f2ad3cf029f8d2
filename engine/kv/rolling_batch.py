"""The rolling batch: the running rows' KV as sub-batches, laid out anew when rows join or leave
(in place where a sub-batch can take the change, `SubBatch.can_take`).

Under a KV budget (engine.kv.budget) every layout takes a `limit` in bytes, and the slabs'
blocks never add up to more. Admission keeps every sub-batch's claim (its rows times the longest
reservation among them, `SubBatch.claim_bytes`) within the limit together; spare rows and
columns beyond the claims are taken only where they fit, and given back (`SubBatch.compact`)
when a claim needs them.
"""

from __future__ import annotations

from engine.kv.batch import SubBatch, build_sub_batch
from engine.kv.slab_sizing import RowOwner, claim_columns
from engine.kv.slabs import RowKV


class RollingBatch:
    """The running rows' KV, as sub-batches. Regrouped to a new partition when membership changes.
    """

    def __init__(self) -> None:
        self.sub_batches: list[SubBatch] = []

    def kv_bytes(self) -> int:
        return sum(sb.kv_bytes() for sb in self.sub_batches)

    def allocated_bytes(self) -> int:
        return sum(sb.allocated_bytes() for sb in self.sub_batches)

    def padded_tokens(self) -> int:
        return sum(sb.padded_tokens() for sb in self.sub_batches)

    def clear(self) -> None:
        """Drop every row (their jobs ended)."""
        self.sub_batches = []

    def regroup(self, groups: list[list[RowOwner]], new_rows: dict[RowOwner, RowKV],
                limit: int | None = None) -> None:
        """Lay the rows out as `groups`, editing a sub-batch in place where a group is its rows
        less some plus newly prefilled ones that fit (`SubBatch.can_take`), else building a fresh
        slab. Rows come from their current sub-batch or, newly prefilled, from `new_rows`. Rows
        in no group are dropped.

        Under a `limit` (bytes), each fresh slab takes at most what the edited ones and the
        claims of the fresh ones still to build leave; when the edited ones leave too little
        for those claims, every group is built fresh (the claims alone fit the limit).
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

        def sources(group: list[RowOwner]) -> list[tuple[SubBatch, int] | RowKV]:
            return [new_rows[s] if s in new_rows else where[s] for s in group]

        fresh = [gi for gi in range(len(groups)) if gi not in edits]
        claims = {gi: _claim(groups[gi], sources(groups[gi])) for gi in fresh}
        held = sum(sb.allocated_bytes() for sb in edits.values())
        if limit is not None and held + sum(claims.values()) > limit:
            edits, held, fresh = {}, 0, list(range(len(groups)))
            claims = {gi: _claim(groups[gi], sources(groups[gi])) for gi in fresh}
        pending = sum(claims.values())
        # Fresh slabs first: they read rows from sub-batches that the edits below rewrite.
        result: list[SubBatch | None] = [None] * len(groups)
        for gi in fresh:
            pending -= claims[gi]
            most = None if limit is None else limit - held - pending
            result[gi] = build_sub_batch(groups[gi], sources(groups[gi]), most)
            held += result[gi].allocated_bytes()
        for gi, sb in edits.items():
            members = set(groups[gi])
            sb.drop({s for s in sb.seqs if s not in members})
            for s in groups[gi]:
                if home(s) is not sb:
                    sb.add(s, new_rows[s])
            result[gi] = sb
        self.sub_batches = result

    def make_room(self, limit: int | None = None, compact: bool = False) -> None:
        """Before a step's forward: give every sub-batch the columns its rows write
        (`SubBatch.reserve`). Under a `limit` (bytes) a move takes at most what the other
        sub-batches leave; when that is less than its claim, or the batch already holds more
        than the limit (a prompt admitted since took its share), or when asked to `compact`,
        the others first give back what their rows cannot use (`SubBatch.compact`)."""
        if compact or (limit is not None and self.allocated_bytes() > limit):
            self._compact(keep=None)
        for sb in self.sub_batches:
            columns = sb.width + sb.feeds()
            if sb.fits(columns):
                continue
            if limit is None:
                sb.reserve(columns)
                continue
            room = limit - self.allocated_bytes() + sb.allocated_bytes()
            if room < sb.claim_bytes():
                self._compact(keep=sb)
                room = limit - self.allocated_bytes() + sb.allocated_bytes()
            sb.reserve(columns, room)

    def _compact(self, keep: SubBatch | None) -> None:
        for sb in self.sub_batches:
            if sb is not keep and sb.allocated_bytes() > sb.claim_bytes():
                sb.compact()


def _claim(group: list[RowOwner], sources: list[tuple[SubBatch, int] | RowKV]) -> int:
    """Bytes a fresh slab of `group` may come to need (`SubBatch.claim_bytes`)."""
    src = sources[0]
    if isinstance(src, RowKV):
        cell = sum(k.shape[0] * k.shape[-1] * k.element_size() +
                   v.shape[0] * v.shape[-1] * v.element_size()
                   for k, v in zip(src.keys, src.values))
    else:
        cell = src[0].cell_bytes
    return len(group) * claim_columns(group) * cell
