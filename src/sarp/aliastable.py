"""A writer's aliases in memory, and their form in LMDB's ``aliases`` table.

Only a write reads the aliases (:mod:`sarp.aliases`), and one process writes an index
at a time, so on LMDB the writer keeps them in a hash table in memory
(``sarp._native.AliasTable``; :class:`PyTable` is its reference) and the table on
disk holds them as a dump and a journal:

``D`` + chunk (u32 BE)  -> up to ``DUMP_CHUNK`` aliases: their roots, engine hashes and
                           token keys, three columns of u64 LE
``J`` + sequence (u64 BE) -> one call's change, appended: ``P`` (put) or ``X`` (delete),
                           then the roots as a column (or ``p``/``x`` and one root for
                           all), then the hashes and, for a put, the keys

A commit appends a record or two at the table's end, where a B-tree keyed by the
aliases themselves had a page to copy per alias (docs/performance.md, issue 26).  Once
the journal holds more changes than ``max(COMPACT_MIN, aliases)``, the write that
passes it empties the table and writes the dump again (sequential, 24 bytes an alias:
amortized, a few bytes per change).  A writer reads the table back at its first write
(:meth:`Aliases.load`: the dump, then the journal in order), and again after a write
that failed, since what the failed write changed in memory never reached the disk.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np

from . import native
from .errors import DamagedIndexError
from .folder import REPAIR_HINT

DUMP, JOURNAL = b"D", b"J"
DUMP_CHUNK = 1 << 16  # aliases per dump record (1.5 MB)
COMPACT_MIN = 1 << 16  # journaled changes before a dump, at least
_CHUNK = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_EMPTY = np.zeros(0, np.uint64)


class PyTable:
    """The reference of ``sarp._native.AliasTable``: a dict, with the same calls.

    >>> t = PyTable()
    >>> t.put(np.array([1], np.uint64), np.array([5, 6], np.uint64), np.array([50, 60], np.uint64))
    >>> keys, found = t.get(np.array([1], np.uint64), np.array([6, 7], np.uint64))
    >>> np.frombuffer(keys, np.uint64).tolist(), np.frombuffer(found, bool).tolist()
    ([60, 0], [True, False])
    """

    def __init__(self) -> None:
        self._d: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        """An estimate: a dict slot, a key tuple and three ints, about 100 B an alias."""
        return 100 * len(self._d)

    @staticmethod
    def _pairs(roots: np.ndarray, hashes: np.ndarray) -> list[tuple[int, int]]:
        roots = np.broadcast_to(roots, hashes.shape) if roots.size == 1 else roots
        if roots.size != hashes.size:
            raise ValueError(f"{roots.size} roots, {hashes.size} hashes")
        return list(zip(roots.tolist(), hashes.tolist(), strict=True))

    def get(self, roots: np.ndarray, hashes: np.ndarray) -> tuple[bytes, bytes]:
        got = [self._d.get(p) for p in self._pairs(roots, hashes)]
        keys = np.array([0 if k is None else k for k in got], np.uint64)
        return keys.tobytes(), np.array([k is not None for k in got], bool).tobytes()

    def put(self, roots: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        if keys.size != hashes.size:
            raise ValueError(f"{hashes.size} hashes and {keys.size} keys")
        self._d.update(zip(self._pairs(roots, hashes), keys.tolist(), strict=True))

    def delete(self, roots: np.ndarray, hashes: np.ndarray) -> int:
        pop = self._d.pop
        return sum(pop(p, None) is not None for p in self._pairs(roots, hashes))

    def scan(self, start: int, count: int) -> tuple[bytes, bytes, bytes, int]:
        items = list(self._d.items())[start : start + count]
        at = start + len(items)
        return (*self._columns(items), at if at < len(self._d) else -1)

    def items(self) -> tuple[bytes, bytes, bytes]:
        return self._columns(list(self._d.items()))

    def clear(self) -> None:
        self._d.clear()

    @staticmethod
    def _columns(items: list) -> tuple[bytes, bytes, bytes]:
        pairs = np.array([p for p, _ in items], np.uint64).reshape(-1, 2)
        keys = np.array([k for _, k in items], np.uint64)
        return pairs[:, 0].tobytes(), pairs[:, 1].tobytes(), keys.tobytes()


def new_table():
    """An empty table: the C one, or the reference without the extension."""
    if native.C is None:
        native.ran_python("alias_table")
        return PyTable()
    return native.C.AliasTable()


class Aliases:
    """One writer's aliases: the table in memory and where its journal stands.

    Cost: a lookup, put or delete is a hash probe per alias in C; a put or delete
    makes one journal record (numpy, no Python per alias).

    >>> a = Aliases()
    >>> a.load([])
    >>> rec = a.put(np.array([7], np.uint64), np.array([3], np.uint64), np.array([30], np.uint64))
    >>> rec[0], a.get(7, np.array([3, 4], np.uint64))[0].tolist()
    (b'J\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00', [30, 0])
    >>> b = Aliases()
    >>> b.load([rec])
    >>> len(b), b.get(7, np.array([3], np.uint64))[0].tolist()
    (1, [30])
    """

    __slots__ = ("_table", "_next_seq", "_journaled", "loaded")

    def __init__(self) -> None:
        self._table = None
        self._next_seq = 0
        self._journaled = 0
        self.loaded = False

    def __len__(self) -> int:
        return len(self._table) if self._table is not None else 0

    @property
    def nbytes(self) -> int:
        """The table's memory: in C 25 B a slot, 36-72 B an alias while it grows (at
        most 70% full, 35% just after a doubling; deletes leave it emptier)."""
        return self._table.nbytes if self._table is not None else 0

    def forget(self) -> None:
        """Read the table from disk again at the next write (a write failed)."""
        self.loaded = False

    def load(self, records: Iterable[tuple[bytes, bytes]], where: object = "aliases") -> None:
        """The table from its records in key order (a cursor over ``aliases``): the dump,
        then the journal.  A record of the wrong size is :class:`DamagedIndexError`."""
        table = new_table() if self._table is None else self._table
        table.clear()
        self._next_seq, self._journaled = 0, 0
        for key, value in records:
            key, value = bytes(key), memoryview(value)
            kind = key[:1]
            if kind == DUMP and len(key) == 5 and len(value) % 24 == 0:
                cols = np.frombuffer(value, "<u8").reshape(3, -1)
                table.put(cols[0], cols[1], cols[2])
            elif kind == JOURNAL and len(key) == 9 and (count := _replay(table, value)) >= 0:
                self._next_seq = _SEQ.unpack(key[1:])[0] + 1
                self._journaled += count
            else:
                raise DamagedIndexError(f"{where}: an aliases entry {key[:9].hex()} of "
                                        f"{len(value)} bytes is not of this format. "
                                        f"{REPAIR_HINT.format(path=where)}")
        self._table = table
        self.loaded = True

    def get(self, root: int, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, found)`` of engine hashes under ``root``, aligned with them (key 0
        where there is none; the store contract's ``alias_get``)."""
        keys, found = self._table.get(np.array([root], np.uint64),
                                      np.ascontiguousarray(hashes, np.uint64))
        return np.frombuffer(keys, np.uint64), np.frombuffer(found, bool)

    def put(self, roots: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> tuple[bytes, bytes]:
        """Set aliases; the journal record to append."""
        roots, hashes, keys = (np.ascontiguousarray(a, np.uint64) for a in (roots, hashes, keys))
        self._table.put(roots, hashes, keys)
        return self._record(b"P", roots, hashes, keys)

    def delete(self, roots: np.ndarray, hashes: np.ndarray) -> tuple[bytes, bytes]:
        """Delete aliases; the journal record to append."""
        roots, hashes = (np.ascontiguousarray(a, np.uint64) for a in (roots, hashes))
        self._table.delete(roots, hashes)
        return self._record(b"X", roots, hashes)

    def scan(self, cursor: int | None, count: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int | None]:
        """Up to ``count`` aliases from ``cursor`` on (None: the start), and where to
        go on (None: the end was reached)."""
        r, h, k, after = self._table.scan(cursor or 0, count)
        cols = (np.frombuffer(c, np.uint64) for c in (r, h, k))
        return (*cols, None if after < 0 else after)

    def compaction_due(self) -> bool:
        """Has the journal passed ``max(COMPACT_MIN, aliases)`` changes?"""
        return self._journaled > max(COMPACT_MIN, len(self._table))

    def dump(self) -> list[tuple[bytes, bytes]]:
        """The table as dump records, in key order (the journal starts over after)."""
        r, h, k = (np.frombuffer(c, np.uint64) for c in self._table.items())
        self._journaled = 0
        return [(DUMP + _CHUNK.pack(i // DUMP_CHUNK),
                 b"".join(c[i : i + DUMP_CHUNK].astype("<u8").tobytes() for c in (r, h, k)))
                for i in range(0, r.size, DUMP_CHUNK)]

    def _record(self, op: bytes, roots: np.ndarray, *cols: np.ndarray) -> tuple[bytes, bytes]:
        one = roots.size == 1 and cols[0].size != 1
        head = op.lower() + roots.astype("<u8").tobytes() if one else op
        if not one:
            cols = (np.broadcast_to(roots, cols[0].shape), *cols)
        key = JOURNAL + _SEQ.pack(self._next_seq)
        self._next_seq += 1
        self._journaled += cols[-1].size
        return key, head + b"".join(c.astype("<u8").tobytes() for c in cols)


def _replay(table, value: memoryview) -> int:
    """Apply one journal record to ``table``: the aliases it names, or -1 when it is
    not one."""
    op = bytes(value[:1])
    width = 3 if op in (b"P", b"p") else 2 if op in (b"X", b"x") else 0
    one = op in (b"p", b"x")
    body = value[9:] if one else value[1:]
    columns = width - one
    if not width or len(value) < 1 + 8 * one or len(body) % (8 * columns):
        return -1
    cols = np.frombuffer(body, "<u8").reshape(columns, -1)
    roots = np.frombuffer(value[1:9], "<u8") if one else cols[0]
    rest = cols if one else cols[1:]
    if width == 3:
        table.put(roots, rest[0], rest[1])
    else:
        table.delete(roots, rest[0])
    return int(rest[0].size)
