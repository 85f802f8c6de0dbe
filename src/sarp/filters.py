"""Holder filters: per holder, a roaring bitmap of the segments it holds blocks in.

The only module that imports pyroaring.  ``clear(holder)`` walks a holder's
bitmap instead of scanning the store, and the bitmaps travel in the snapshot as
roaring's portable serialisation.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from pyroaring import BitMap

_ENTRY = struct.Struct("<HI")
FEW = 8  # segments discard_many_everywhere takes out one by one, below this many


class HolderSegments:
    """holder id -> roaring bitmap of segment ids.

    >>> h = HolderSegments()
    >>> h.add(3, 10); h.add(3, 11); h.discard(3, 10)
    >>> h.segments(3)
    [11]
    """

    __slots__ = ("_maps",)

    def __init__(self) -> None:
        self._maps: dict[int, BitMap] = {}

    def add(self, holder_id: int, seg_id: int) -> None:
        bm = self._maps.get(holder_id)
        if bm is None:
            bm = self._maps[holder_id] = BitMap()
        bm.add(seg_id)

    def add_many(self, holder_id: int, seg_ids: Iterable[int]) -> None:
        bm = self._maps.get(holder_id)
        if bm is None:
            bm = self._maps[holder_id] = BitMap()
        bm.update(seg_ids)

    def discard(self, holder_id: int, seg_id: int) -> None:
        bm = self._maps.get(holder_id)
        if bm is not None:
            bm.discard(seg_id)

    def add_rows(self, rows: Iterable[tuple[int, Iterable[int]]]) -> None:
        """:meth:`add` for each ``(segment id, holder ids)`` row, in one loop (a
        commit's new rows, with no method call per row).

        >>> f = HolderSegments()
        >>> f.add_rows([(7, [1, 2]), (8, [2])])
        >>> f.segments(1), f.segments(2)
        ([7], [7, 8])
        """
        maps = self._maps
        for seg_id, holder_ids in rows:
            for holder_id in holder_ids:
                bm = maps.get(holder_id)
                if bm is None:
                    bm = maps[holder_id] = BitMap()
                bm.add(seg_id)

    def discard_rows(self, rows: Iterable[tuple[int, Iterable[int]]]) -> None:
        """:meth:`discard` for each ``(segment id, holder ids)`` row, in one loop."""
        maps = self._maps
        for seg_id, holder_ids in rows:
            for holder_id in holder_ids:
                bm = maps.get(holder_id)
                if bm is not None:
                    bm.discard(seg_id)

    def discard_many_everywhere(self, seg_ids: Iterable[int]) -> None:
        """Each of ``seg_ids`` out of every holder's bitmap: one difference per holder
        (for a few, a discard each: cheaper than a bitmap made for them)."""
        ids = list(seg_ids)
        if len(ids) < FEW:
            for bm in self._maps.values():
                for seg_id in ids:
                    bm.discard(seg_id)
            return
        gone = BitMap(ids)
        for bm in self._maps.values():
            bm.difference_update(gone)

    def segments(self, holder_id: int) -> list[int]:
        bm = self._maps.get(holder_id)
        return [] if bm is None else list(bm)

    def as_sets(self) -> dict[int, set[int]]:
        return {h: set(bm) for h, bm in self._maps.items() if bm}

    def serialize(self) -> bytes:
        parts = []
        for holder_id, bm in sorted(self._maps.items()):
            bm.run_optimize()
            raw = bm.serialize()
            parts.append(_ENTRY.pack(holder_id, len(raw)) + raw)
        return b"".join(parts)

    @classmethod
    def deserialize(cls, raw: bytes | memoryview) -> HolderSegments:
        out = cls()
        view = memoryview(raw)
        pos = 0
        while pos < len(view):
            holder_id, size = _ENTRY.unpack_from(view, pos)
            pos += _ENTRY.size
            out._maps[holder_id] = BitMap.deserialize(bytes(view[pos : pos + size]))
            pos += size
        return out

    def nbytes(self) -> int:
        """Serialized size of the bitmaps (roaring's in-memory size tracks it closely)."""
        total = 0
        for bm in self._maps.values():
            stats = bm.get_statistics()
            total += sum(stats[f"n_bytes_{kind}_containers"] for kind in ("array", "run", "bitset"))
        return total
