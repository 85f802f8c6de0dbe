"""A write's working set: the segments one write transaction touched, written once at
its end (:class:`Touched`), and what it changed (:class:`Plan`), which the index
applies to memory only after the commit, so a failed write changes nothing in memory;
:func:`with_state`, the small named values a write carries; :class:`Deaths`, the
blocks a packer's writes deleted.
:mod:`sarp.packing` fills them; ``packing.c`` mirrors :meth:`Touched.flush`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .segment import Segment, writable
from .store import WriteTxn


@dataclass(slots=True)
class Plan:
    """What a committed write changed, to apply to memory afterwards."""

    holder_names: list[tuple[int, str]] = field(default_factory=list)  # created by the write
    # (segment id, first hash, holder ids now in it or None if deleted, is new)
    segments: list[tuple[int, int, list[int] | None, bool]] = field(default_factory=list)
    dropped: dict[int, list[int]] = field(default_factory=dict)
    new_blocks: int = 0
    removed_blocks: int = 0
    removed_per_op: list[int] = field(default_factory=list)  # a batch's, in order


def with_state(write, state):
    """A batch's write function: ``write`` (None: nothing but the state), then the named
    values of ``state`` put in the same transaction (``WriteTxn.put_state``) unless an
    operation was refused, for the caller's follow-up commit to carry them."""
    def run(w: WriteTxn) -> tuple[Plan, list]:
        plan, refused = (Plan(), []) if write is None else write(w)
        if not refused:
            for name, data in (state or {}).items():
                w.put_state(name, data)
        return plan, refused
    return run


class Deaths:
    """The hashes of the blocks that left the index (their segment deleted, nobody
    holding any of it) in one packer's writes, committed or not, since the aliases'
    sweep last took them (:func:`sarp.aliases._sweep` looks at their aliases first).
    At most ``KEEP`` are kept: past it they are dropped, and ``take`` says so.

    >>> d = Deaths()
    >>> d.add(np.array([7, 8], np.uint64))
    >>> d.take()[0].tolist(), d.take()[0].tolist()
    ([7, 8], [])
    """

    KEEP = 1 << 18  # 2 MB: an index without aliases has no sweep to take them

    __slots__ = ("_parts", "_count", "_lost")

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._count, self._lost = 0, False

    def add(self, hashes: np.ndarray) -> None:
        if self._count + hashes.size > self.KEEP:
            self._parts, self._count, self._lost = [], 0, True
        else:
            self._parts.append(hashes)
            self._count += hashes.size

    @property
    def nbytes(self) -> int:
        return 8 * self._count

    def take(self) -> tuple[np.ndarray, bool]:
        """``(hashes, lost)``: those kept since the last call, and whether some were
        dropped meanwhile; then forgets them."""
        out = np.concatenate(self._parts) if self._parts else np.zeros(0, np.uint64)
        lost = self._lost
        self._parts, self._count, self._lost = [], 0, False
        return out, lost


class Touched:
    """Segments read or created inside one write transaction, written back by ``flush``
    (the blocks of those it deletes noted in ``deaths``, when given)."""

    __slots__ = ("_w", "_segs", "_new", "_heads", "_cleared", "_names", "_deaths")

    def __init__(self, w: WriteTxn, deaths: Deaths | None = None) -> None:
        self._w = w
        self._deaths = deaths
        self._segs: dict[int, Segment] = {}
        self._new: set[int] = set()
        self._heads: dict[int, int] = {}  # first hash -> id, for segments created here
        self._cleared: set[int] = set()  # segments where a row may hold nothing now
        self._names: dict[str, int | None] = {}  # holder name -> id, as looked up here

    def fetch_ahead(self, seg_ids: list[int]) -> None:
        """Segments this write will read, fetched at once where each read is a round
        trip (``capabilities.prefetch``); nothing on LMDB."""
        if self._w.capabilities.prefetch and seg_ids:
            self._w.prefetch_segments(np.array(seg_ids, np.uint64))

    def holder_id(self, name: str) -> int | None:
        """The id of holder ``name`` (None if it has none), looked up once per write."""
        try:
            return self._names[name]
        except KeyError:
            holder_id = self._names[name] = self._w.holder_id(name, create=False)
            return holder_id

    def named(self, name: str, holder_id: int) -> None:
        """Holder ``name`` was just given ``holder_id`` (a reused id drops its old name)."""
        self._names = {n: h for n, h in self._names.items() if h != holder_id}
        self._names[name] = holder_id

    def cleared(self, seg_id: int) -> None:
        """Note that a row of ``seg_id`` may now hold nothing (flush drops such rows)."""
        self._cleared.add(seg_id)

    def head(self, first_hash: int) -> int | None:
        """A segment created in this transaction whose first block is ``first_hash``."""
        return self._heads.get(first_hash)

    def holds(self, seg_id: int) -> bool:
        """Has this write read, created or emptied segment ``seg_id``?"""
        return seg_id in self._segs

    def get(self, seg_id: int) -> Segment:
        seg = self._segs.get(seg_id)
        if seg is None:
            seg = self._segs[seg_id] = self._w.segment(seg_id)
        return seg

    def holder_ids(self) -> set[int]:
        """Every holder id with a row in a touched segment."""
        return {int(h) for seg in self._segs.values() for h in seg.holder_ids}

    def holding(self, holder_id: int) -> set[int]:
        """Touched segments with a row for ``holder_id``."""
        return {sid for sid, seg in self._segs.items() if holder_id in seg.holder_ids}

    def take_over(self, segments: list[tuple[int, bytes, bool, bool]],
                  names: dict[str, int | None]) -> None:
        """Carry on from a batch begun in C: its touched segments as ``(id, record,
        is_new, cleared)``, in the order first touched, and the holder ids it looked up.
        """
        for seg_id, record, is_new, cleared in segments:
            seg = self._segs[seg_id] = writable(seg_id, record)
            if is_new:
                self._new.add(seg_id)
                self._heads[int(seg.hashes[0])] = seg_id
            if cleared:
                self._cleared.add(seg_id)
        self._names.update(names)

    def add_new(self, seg: Segment) -> None:
        self._segs[seg.seg_id] = seg
        self._new.add(seg.seg_id)
        self._heads[int(seg.hashes[0])] = seg.seg_id

    def flush(self, plan: Plan) -> None:
        entries = []
        for seg_id, seg in self._segs.items():
            dropped = seg.drop_empty_rows() if seg_id in self._cleared else None
            first_hash = int(seg.hashes[0])
            if dropped:
                plan.dropped[seg_id] = dropped
            if not seg.holder_ids.size:
                self._w.delete_segment(seg)
                if self._deaths is not None:
                    self._deaths.add(seg.hashes)
                plan.segments.append((seg_id, first_hash, None, False))
            else:
                self._w.put_segment(seg)
                plan.segments.append(
                    (seg_id, first_hash, seg.holder_ids.tolist(), seg_id in self._new)
                )
            entries.append((seg_id, first_hash))
        if entries:
            self._w.log(entries)
