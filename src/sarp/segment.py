"""Segment records: up to ``S`` consecutive blocks of one chain in one LMDB value.

Layout (little-endian, every section 8-byte aligned)::

    header    24 B   magic b"SG", version u8, flags u8, n u16, nh u16, start_pos u64, parent u64
    hashes    8n     the blocks' hashes, in chain order
    holders   2nh    holder ids (u16) that hold at least one block here, padded to 8
    presence  nh*n   1 if holder row r holds block i, padded to 8
    meta      8nh*n  int64 per (holder, block), only when flags & HAS_META; -1 = none
    checksum  8      xxh3-64 of everything before it

A record is decoded and checked (checksum, sizes) on every read; a bad one raises
:class:`~sarp.errors.CorruptRecordError` naming the segment.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from . import native
from .errors import CorruptRecordError
from .hashing import checksum

MAGIC = b"SG"
RECORD_VERSION = 1
HAS_META = 0x01
IS_ROOT = 0x02
_HEADER = struct.Struct("<2sBBHHQQ")
_U64 = struct.Struct("<Q")  # a checksum, or a hash


def _pad8(nbytes: int) -> int:
    return (nbytes + 7) & ~7


@dataclass(slots=True)
class Segment:
    """One segment: ``hashes[i]`` sits at chain position ``start_pos + i``.

    ``parent`` is the hash of the block before ``hashes[0]`` (``None`` for a
    chain's first block).  ``presence[r, i]`` says whether holder
    ``holder_ids[r]`` holds block ``i``; ``meta[r, i]`` is that holder's
    metadata for it (``-1`` when none was given).
    """

    seg_id: int
    start_pos: int
    parent: int | None
    hashes: np.ndarray
    holder_ids: np.ndarray
    presence: np.ndarray
    meta: np.ndarray | None = None
    # (record buffer, the arrays decoded onto it) when :func:`writable` made this
    # segment: while the same arrays are in place, edits to them are edits to the
    # buffer, and :meth:`encode` only renews the checksum.
    source: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def num_blocks(self) -> int:
        return int(self.hashes.size)

    def row_of(self, holder_id: int) -> int:
        """Row of ``holder_id`` in ``presence``, adding an empty row if it has none."""
        holders = self.holder_ids.tolist()  # a handful: a list beats numpy calls here
        if holder_id in holders:
            return holders.index(holder_id)
        nh, n = len(holders), self.num_blocks
        self.holder_ids = np.append(self.holder_ids, np.uint16(holder_id))
        presence = np.zeros((nh + 1, n), np.uint8)
        presence[:nh] = self.presence
        self.presence = presence
        if self.meta is not None:
            meta = np.full((nh + 1, n), -1, np.int64)
            meta[:nh] = self.meta
            self.meta = meta
        return nh

    def set_meta(self, row: int, offsets: np.ndarray, values: np.ndarray) -> None:
        if self.meta is None:
            self.meta = np.full(self.presence.shape, -1, dtype=np.int64)
        self.meta[row, offsets] = values

    def append(self, hashes: np.ndarray, holder_id: int, meta: np.ndarray | None) -> None:
        """Append blocks held by ``holder_id`` at the tail (packing a chain's tail)."""
        k, old = hashes.size, self.num_blocks
        row = self.row_of(holder_id)
        rows = self.presence.shape[0]
        self.hashes = np.concatenate([self.hashes, hashes])
        presence = np.zeros((rows, old + k), np.uint8)
        presence[:, :old] = self.presence
        presence[row, old:] = 1
        self.presence = presence
        if self.meta is None and meta is not None:
            self.meta = np.full((rows, old), -1, dtype=np.int64)
        if self.meta is not None:
            grown = np.full((rows, old + k), -1, dtype=np.int64)
            grown[:, :old] = self.meta
            if meta is not None:
                grown[row, old:] = meta
            self.meta = grown

    def drop_empty_rows(self) -> list[int]:
        """Remove holder rows that hold nothing; return the holder ids removed."""
        if self.presence.shape[0] == 1:  # the common case, without a reduction per row
            if np.count_nonzero(self.presence):
                return []
            keep = np.zeros(1, bool)
        else:
            keep = self.presence.any(axis=1)
            if keep.all():
                return []
        gone = self.holder_ids[~keep].tolist()
        self.holder_ids = self.holder_ids[keep]
        self.presence = self.presence[keep]
        if self.meta is not None:
            self.meta = self.meta[keep]
        return gone

    def encode(self) -> bytes:
        """Serialise to the record layout above.

        >>> s = Segment(7, 0, None, np.array([5, 6], np.uint64), np.array([1], np.uint16),
        ...             np.ones((1, 2), np.uint8))
        >>> decode(7, s.encode()).hashes.tolist()
        [5, 6]
        """
        if self.source is not None:
            buf, hashes, holder_ids, presence, meta = self.source
            if (hashes is self.hashes and holder_ids is self.holder_ids
                    and presence is self.presence and meta is self.meta):
                body = memoryview(buf)[: len(buf) - 8]
                _U64.pack_into(buf, len(buf) - 8, checksum(body))
                return bytes(buf)
        n, nh = self.num_blocks, int(self.holder_ids.size)
        flags = (HAS_META if self.meta is not None else 0) | (IS_ROOT if self.parent is None else 0)
        parts = [
            _HEADER.pack(MAGIC, RECORD_VERSION, flags, n, nh, self.start_pos, self.parent or 0),
            self.hashes.astype("<u8", copy=False).tobytes(),
            _padded(self.holder_ids.astype("<u2", copy=False).tobytes()),
            _padded(np.ascontiguousarray(self.presence, dtype=np.uint8).tobytes()),
        ]
        if self.meta is not None:
            parts.append(self.meta.astype("<i8", copy=False).tobytes())
        body = b"".join(parts)
        return body + _U64.pack(checksum(body))


def _padded(raw: bytes) -> bytes:
    return raw + b"\0" * (_pad8(len(raw)) - len(raw))


HASHES_AT = _HEADER.size  # where a record's hashes start


def _sections(n: int, nh: int) -> tuple[int, int, int]:
    """Where a record of ``n`` blocks and ``nh`` holders keeps its holder ids, its
    presence rows and its meta (the module docstring's layout)."""
    holders_at = HASHES_AT + 8 * n
    presence_at = holders_at + _pad8(2 * nh)
    return holders_at, presence_at, presence_at + _pad8(nh * n)


def layout(seg_id: int, record: bytes) -> tuple[int, int, int, int, int | None, int, int, int]:
    """Check a record (checksum, magic, sizes) and locate its sections: ``(flags,
    num_blocks, num_holders, start_pos, parent, holders_at, presence_at, meta_at)``.

    Cost: one xxh3 pass over the record; no per-block work, no object built.
    """
    size = len(record)
    if size < _HEADER.size + _U64.size:
        raise CorruptRecordError(f"segment {seg_id}: record of {size} bytes is too short")
    (stored,) = _U64.unpack_from(record, size - 8)
    body = record[: size - 8] if size <= 4096 else memoryview(record)[: size - 8]
    if checksum(body) != stored:
        raise CorruptRecordError(f"segment {seg_id}: checksum mismatch")
    magic, version, flags, n, nh, start_pos, parent = _HEADER.unpack_from(record, 0)
    if magic != MAGIC or version != RECORD_VERSION:
        raise CorruptRecordError(f"segment {seg_id}: bad magic {magic!r} or version {version}")
    hid_off, pres_off, meta_off = _sections(n, nh)
    expected = meta_off + (8 * nh * n if flags & HAS_META else 0) + 8
    if expected != size:
        raise CorruptRecordError(f"segment {seg_id}: {size} bytes, layout says {expected}")
    if nh > 1 and len(set(struct.unpack_from(f"<{nh}H", record, hid_off))) != nh:
        # a holder named twice: its rows would be read differently by each walk
        raise CorruptRecordError(f"segment {seg_id}: a holder id appears twice")
    return (flags, n, nh, start_pos, None if flags & IS_ROOT else parent, hid_off, pres_off,
            meta_off)


def head(seg_id: int, record: bytes) -> tuple[int, list[int]]:
    """Check a record and return what the directory and the holder filters need of it:
    ``(first_hash, holder_ids)``.

    Cost: one xxh3 pass; no arrays built but the holder ids.

    >>> rec = Segment(1, 0, None, np.array([5, 6], np.uint64), np.array([4, 9], np.uint16),
    ...               np.array([[1, 0], [0, 1]], np.uint8)).encode()
    >>> head(1, rec)
    (5, [4, 9])
    """
    _, n, nh, _, _, holders_at, _, _ = layout(seg_id, record)
    first = _U64.unpack_from(record, HASHES_AT)[0] if n else 0
    return first, np.frombuffer(record, "<u2", nh, holders_at).tolist()


# What each of the C check's codes (native.h, BAD_*) means, in the words of
# :func:`layout`'s message for the same damage.
DAMAGE = {-1: "is too short", -2: "checksum mismatch", -3: "bad magic", -4: "layout says",
          -5: "appears twice"}


def heads_py(records: Sequence[bytes | None]) -> tuple[bytes, bytes, bytes, bytes]:
    """:func:`head` of many records at once, for a reader's replay of the log:
    ``(firsts, states, counts, holder_ids)`` as bytes: per record its first hash (u64,
    0 unless it passed), its state (int8: 1 checked, 0 None, a segment that is gone;
    negative, a damaged record: :data:`DAMAGE`'s code) and its number of holder ids
    (int64); then the holder ids (u16) of every record that passed, in order.

    Cost: :func:`head` per record; :func:`heads` is this in one C call.

    >>> rec = Segment(1, 0, None, np.array([5, 6], np.uint64), np.array([4, 9], np.uint16),
    ...               np.array([[1, 0], [0, 1]], np.uint8)).encode()
    >>> firsts, states, counts, ids = heads_py([rec, None, rec[:-1] + b"?"])
    >>> (np.frombuffer(firsts, "<u8").tolist(), np.frombuffer(states, np.int8).tolist(),
    ...  np.frombuffer(counts, "<i8").tolist(), np.frombuffer(ids, "<u2").tolist())
    ([5, 0, 0], [1, 0, -2], [2, 0, 0], [4, 9])
    """
    firsts = np.zeros(len(records), "<u8")
    states = np.zeros(len(records), np.int8)
    counts = np.zeros(len(records), "<i8")
    ids: list[int] = []
    for i, record in enumerate(records):
        if record is None:
            continue
        try:
            firsts[i], held = head(0, record)
        except CorruptRecordError as exc:
            states[i] = next(code for code, words in DAMAGE.items() if words in str(exc))
            continue
        states[i], counts[i] = 1, len(held)
        ids += held
    return (firsts.tobytes(), states.tobytes(), counts.tobytes(),
            np.array(ids, "<u2").tobytes())


def heads(records: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                    np.ndarray]:
    """:func:`heads_py` in C (``segment.c``) when :mod:`sarp.native` has it, as arrays:
    ``(firsts uint64, states int8, counts int64, holder_ids uint16)``.

    Cost: one C call and four small arrays, no Python per record.

    >>> rec = Segment(7, 0, None, np.array([5], np.uint64), np.array([3], np.uint16),
    ...               np.array([[1]], np.uint8)).encode()
    >>> [a.tolist() for a in heads([None, rec])]
    [[0, 5], [0, 1], [0, 1], [3]]
    """
    c = native.C
    if c is None:
        native.ran_python("heads")
        out = heads_py(records)
    else:
        out = c.heads(records)
    return (np.frombuffer(out[0], "<u8").astype(np.uint64), np.frombuffer(out[1], np.int8),
            np.frombuffer(out[2], "<i8").astype(np.int64), np.frombuffer(out[3], "<u2"))


def checked_presence(record: bytes) -> np.ndarray:
    """The presence rows (holders x blocks, uint8) of a record :func:`layout` has
    already checked, as a zero-copy view: no second checksum pass.

    Cost: one header unpack and one numpy view.

    >>> rec = Segment(1, 0, None, np.array([5, 6], np.uint64), np.array([4], np.uint16),
    ...               np.array([[1, 0]], np.uint8)).encode()
    >>> checked_presence(rec).tolist()
    [[1, 0]]
    """
    _, _, _, n, nh, _, _ = _HEADER.unpack_from(record, 0)
    return np.frombuffer(record, np.uint8, nh * n, _sections(n, nh)[1]).reshape(nh, n)


def decode(seg_id: int, record: bytes) -> Segment:
    """Parse and check a record; raise ``CorruptRecordError`` if it is damaged.

    Cost: O(record size): one xxh3 pass and zero-copy numpy views.
    """
    flags, n, nh, start_pos, parent, holders_at, presence_at, meta_at = layout(seg_id, record)
    buf = memoryview(record)
    meta = None
    if flags & HAS_META:
        meta = np.frombuffer(buf, "<i8", nh * n, meta_at).reshape(nh, n)
    return Segment(
        seg_id,
        start_pos,
        parent,
        np.frombuffer(buf, "<u8", n, HASHES_AT),
        np.frombuffer(buf, "<u2", nh, holders_at),
        np.frombuffer(buf, np.uint8, nh * n, presence_at).reshape(nh, n),
        meta,
    )


def writable(seg_id: int, record: bytes) -> Segment:
    """:func:`decode` into arrays that can be modified in place (one copy of the record).

    Cost: O(record size): one xxh3 pass and one copy.
    """
    buf = bytearray(record)
    seg = decode(seg_id, buf)
    seg.source = (buf, seg.hashes, seg.holder_ids, seg.presence, seg.meta)
    return seg
