"""The routing directory: the only index state kept in memory besides the holder filters.

One entry per segment: the segment's first block hash -> its segment id.  That is
enough to route every step of a match exactly, because of how segments are packed
(:mod:`sarp.index`): each block is stored once, and a block is either the first
block of its segment or follows its parent inside the same segment.  So after a
segment's blocks are verified up to position ``L``, the only segment that can hold
query block ``q[L]`` is the one whose first hash is ``q[L]``: one probe per
segment step, never per block, and no candidate can be missed.

The entries live in two sorted numpy arrays (``keys`` uint64, ``segs`` uint32),
which a snapshot stores raw and a restart maps back without a per-entry rebuild,
plus a small dict of changes since the arrays were last merged.  Lookups that hit
the arrays are remembered in a bounded dict (``HOT_ENTRIES``): a binary search from
Python costs about 1 µs of numpy call overhead, a dict probe a tenth of that, and
the segments requests start at repeat.
"""

from __future__ import annotations

import sys

import numpy as np

from . import native

_INT_BYTES = sys.getsizeof(2**62)  # a hash or segment id held as a Python int
HOT_ENTRIES = 1 << 16  # at most this many remembered lookups (about 6 MB at most)


class Directory:
    """First block hash -> segment id, for every live segment.

    >>> d = Directory()
    >>> d.add(42, 7)
    >>> d.lookup(42), d.lookup(43), len(d)
    (7, None, 1)
    """

    __slots__ = ("keys", "segs", "_added", "_removed", "_count", "_hot", "_pending")

    def __init__(self, keys: np.ndarray | None = None, segs: np.ndarray | None = None) -> None:
        self.keys = np.empty(0, np.uint64) if keys is None else keys
        self.segs = np.empty(0, np.uint32) if segs is None else segs
        self._added: dict[int, int] = {}
        self._removed: set[int] = set()
        self._count = int(self.keys.size)
        self._hot: dict[int, int] = {}  # array entries looked up, not removed since
        self._pending: tuple | None = None  # sorted arrays of _added and _removed

    @classmethod
    def from_entries(cls, keys: np.ndarray, segs: np.ndarray) -> Directory:
        """Build from unsorted entries (a rebuild). Cost: O(n log n)."""
        order = np.argsort(keys, kind="stable")
        return cls(keys[order].astype(np.uint64), segs[order].astype(np.uint32))

    def lookup(self, first_hash: int) -> int | None:
        """Segment whose first block is ``first_hash``, or ``None``.

        Cost: O(1) for recent entries, O(log n) binary search otherwise.  The walk in
        C (``sarp._native.walk``) probes :meth:`probe_dicts` first, in this order, and
        calls this for the rest.
        """
        seg = self._added.get(first_hash)
        if seg is None:
            seg = self._hot.get(first_hash)
        if seg is not None:
            return seg
        if not self.keys.size or first_hash in self._removed:
            return None
        i = int(self.keys.searchsorted(np.uint64(first_hash)))
        if i < self.keys.size and self.keys[i] == first_hash:
            seg = int(self.segs[i])
            if len(self._hot) < HOT_ENTRIES:
                self._hot[first_hash] = seg
            return seg
        return None

    def probe_dicts(self) -> tuple[dict[int, int], dict[int, int]]:
        """The two dicts :meth:`lookup` probes before the arrays: changes since the
        last merge, then array entries looked up before (never a removed one)."""
        return self._added, self._hot

    def sorted_probe(self) -> tuple[set[int], np.ndarray, np.ndarray] | None:
        """What C probes after :meth:`probe_dicts` missed, in place of calling
        :meth:`lookup`: the first hashes removed since the last merge, and the sorted
        arrays (None when they are not contiguous uint64 and uint32).  C remembers
        nothing in the second dict.

        >>> d = Directory.from_entries(np.array([5, 9], np.uint64), np.array([1, 2], np.uint32))
        >>> d.remove(9, 2)
        >>> removed, keys, segs = d.sorted_probe()
        >>> sorted(removed), keys.tolist(), segs.tolist()
        ([9], [5, 9], [1, 2])
        """
        if (self.keys.dtype != np.uint64 or self.segs.dtype != np.uint32
                or not (self.keys.flags.c_contiguous and self.segs.flags.c_contiguous)):
            return None
        return self._removed, self.keys, self.segs

    def lookup_many(self, first_hashes: np.ndarray) -> np.ndarray:
        """:meth:`lookup` for many hashes at once: segment ids as int64, -1 where none.

        Cost: one binary search per hash in the arrays, and in sorted copies of the
        changes since the last :meth:`compact` (rebuilt once after each change); in
        one C call (``sarp._native.find``), or a few numpy ones.

        >>> d = Directory.from_entries(np.array([5, 9], np.uint64), np.array([1, 2], np.uint32))
        >>> d.add(7, 3)
        >>> d.remove(9, 2)
        >>> d.lookup_many(np.array([9, 7, 8, 5], np.uint64)).tolist()
        [-1, 3, -1, 1]
        """
        keys = np.ascontiguousarray(first_hashes, np.uint64)
        changed = bool(self._added or self._removed)
        if self._dicts_first(keys.size):
            out = np.full(keys.size, -1, np.int64)
            _find(self.keys, self.segs, keys, out)
            added, removed = self._added, self._removed
            for j, key in enumerate(keys.tolist()):
                seg = added.get(key)
                if seg is not None:
                    out[j] = seg
                elif key in removed:
                    out[j] = -1
            return out
        arrays = self.native_arrays()
        if arrays is not None:
            out = np.empty(keys.size, np.int64)
            native.C.find(out, keys, *arrays)
            return out
        native.ran_python("find")
        out = np.full(keys.size, -1, np.int64)
        _find(self.keys, self.segs, keys, out)
        if changed:
            added, segs, gone = self._pending
            _find(gone, np.full(gone.size, -1, np.int64), keys, out)
            _find(added, segs, keys, out)
        return out

    def predicted_keys(self, query: np.ndarray) -> list[bytes]:
        """The keys (segment ids as u64 big-endian bytes, as the stores key them) of the
        segments a match of ``query`` may read: every segment whose first hash is one of
        the query's, each once, in query order.  A reader of a remote store fetches them
        in one round trip.

        Cost: :meth:`lookup_many`'s probes, and the keys made, in one C call.

        >>> d = Directory.from_entries(np.array([5, 9], np.uint64), np.array([1, 2], np.uint32))
        >>> [int.from_bytes(k, "big") for k in d.predicted_keys(np.array([9, 7, 5, 9], np.uint64))]
        [2, 1]
        """
        keys = np.ascontiguousarray(query, np.uint64)
        if not self._dicts_first(keys.size):
            arrays = self.native_arrays()
            if arrays is not None:
                return native.C.predict(keys, *arrays)
        ids = self.lookup_many(keys)
        return [int(s).to_bytes(8, "big") for s in dict.fromkeys(ids[ids >= 0].tolist())]

    def _dicts_first(self, keys: int) -> bool:
        """Fewer keys than changes not yet sorted: probing the dicts beats sorting them."""
        return self._pending is None and keys < len(self._added) + len(self._removed)

    def native_arrays(self) -> tuple | None:
        """The arrays ``sarp._native``'s probes take (find, predict, read_match): keys,
        segs[, and the changes since they were merged, sorted once per change], or None
        where there is no C (probe from Python)."""
        changed = bool(self._added or self._removed)
        if changed and self._pending is None:
            gone = np.fromiter(self._removed - self._added.keys(), np.uint64)
            gone.sort()
            added = np.fromiter(self._added.keys(), np.uint64, len(self._added))
            segs = np.fromiter(self._added.values(), np.int64, len(self._added))
            order = np.argsort(added)
            self._pending = (added[order], segs[order], gone)
        if native.C is None or self.keys.dtype != np.uint64 or self.segs.dtype != np.uint32:
            return None
        return (self.keys, self.segs, *self._pending) if changed else (self.keys, self.segs)

    def add(self, first_hash: int, seg_id: int) -> None:
        if self.lookup(first_hash) is None:
            self._count += 1
        self._added[first_hash] = seg_id
        self._hot.pop(first_hash, None)
        self._pending = None

    def add_many(self, first_hashes: np.ndarray, seg_ids: np.ndarray) -> None:
        """:meth:`add` of many entries, in order (of a hash named twice, the last).

        Cost: a dict probe per entry, and one binary search for those not added since
        the last :meth:`compact`.

        >>> d = Directory.from_entries(np.array([5], np.uint64), np.array([1], np.uint32))
        >>> d.add_many(np.array([5, 7, 7], np.uint64), np.array([2, 3, 4], np.uint32))
        >>> d.lookup(5), d.lookup(7), len(d)
        (2, 4, 2)
        """
        hashes = first_hashes.tolist()
        added, removed, hot = self._added, self._removed, self._hot
        fresh = {h for h in hashes if h not in added}  # absent, unless in the arrays
        if fresh and self.keys.size:
            probe = np.fromiter(fresh, np.uint64, len(fresh))
            at = np.minimum(self.keys.searchsorted(probe), self.keys.size - 1)
            stored = probe[self.keys[at] == probe].tolist()
            fresh.difference_update(h for h in stored if h not in removed)
        added.update(zip(hashes, seg_ids.tolist(), strict=True))
        if hot:
            for first_hash in hot.keys() & set(hashes):
                del hot[first_hash]
        self._pending = None
        self._count += len(fresh)

    def remove(self, first_hash: int, seg_id: int) -> None:
        """Drop the entry for ``first_hash`` if it names ``seg_id``."""
        if self.lookup(first_hash) != seg_id:
            return
        self._added.pop(first_hash, None)
        self._hot.pop(first_hash, None)
        self._removed.add(first_hash)
        self._pending = None
        self._count -= 1

    def compact(self) -> None:
        """Merge recent changes into the sorted arrays. Cost: O(n log n).

        >>> d = Directory.from_entries(np.array([5, 1, 9], np.uint64), np.array([1, 2, 3]))
        >>> d.remove(9, 3); d.add(7, 4); d.add(5, 6); d.compact()
        >>> d.keys.tolist(), d.segs.tolist()
        ([1, 5, 7], [2, 6, 4])
        """
        if not self._added and not self._removed:
            return
        changed = np.fromiter(self._removed | self._added.keys(), np.uint64)
        # the changed keys found by binary search in the sorted keys (np.isin sorts both,
        # and its np.unique imports numpy.ma: 16 ms at a process's first snapshot)
        keep = np.ones(self.keys.size, bool)
        at = np.searchsorted(self.keys, changed)
        inside = at < self.keys.size
        at = at[inside]
        keep[at[self.keys[at] == changed[inside]]] = False
        add_keys = np.fromiter(self._added.keys(), np.uint64, len(self._added))
        add_segs = np.fromiter(self._added.values(), np.uint32, len(self._added))
        merged = Directory.from_entries(
            np.concatenate([self.keys[keep], add_keys]), np.concatenate([self.segs[keep], add_segs])
        )
        self.keys, self.segs = merged.keys, merged.segs
        self._added.clear()
        self._removed.clear()
        self._pending = None

    def __len__(self) -> int:
        return self._count

    def entries(self) -> dict[int, int]:
        """All entries as a dict (for checks and tests). Cost: O(n)."""
        out = dict(zip(self.keys.tolist(), self.segs.tolist(), strict=True))
        for k in self._removed:
            out.pop(k, None)
        out.update(self._added)
        return out

    def nbytes(self) -> int:
        """Bytes held: the arrays exactly, plus the change and lookup dicts' and the
        set's tables and their int objects (CPython sizes, as ``sys.getsizeof``
        reports them)."""
        pending = len(self._added) + len(self._hot)
        return int(
            self.keys.nbytes
            + self.segs.nbytes
            + sys.getsizeof(self._added)
            + sys.getsizeof(self._hot)
            + sys.getsizeof(self._removed)
            + _INT_BYTES * (2 * pending + len(self._removed))
        )


def _find(sorted_keys: np.ndarray, values: np.ndarray, keys: np.ndarray, out: np.ndarray) -> None:
    """``out[j] = values[i]`` wherever ``keys[j] == sorted_keys[i]``, vectorised."""
    if not sorted_keys.size:
        return
    at = np.minimum(sorted_keys.searchsorted(keys), sorted_keys.size - 1)
    hit = sorted_keys[at] == keys
    out[hit] = values[at[hit]]
