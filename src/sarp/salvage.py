"""The salvage readers of :mod:`sarp.repair`, on LMDB: the counters, the holder names
and the segment records of a damaged index, each read by its own key through LMDB's
live tree and trusting nothing above it, in a child process that a damaged page may
kill (a SIGBUS, an LMDB assertion) without taking repair with it.
"""

from __future__ import annotations

from . import lmdb_env
from .store import HOLDER_ID, MAX_HOLDERS, U64, checked_name


def salvage_records(path: str, first_id: int, last_id: int, conn) -> None:
    """Send ``(seg_id, record)`` for every segment id in ``[first_id, last_id]`` that the
    live B-tree still yields, then ``None``; for :mod:`sarp.repair`, in a child process.

    Reads go through the tree (``get`` by key), never through free pages, so only live
    records come back; a damaged page may kill this process (a SIGBUS or an LMDB
    assertion), which is why it runs in a child: the parent knows the last id sent.
    Every id is reported, found or not: ``(seg_id, None)`` when absent.
    """
    env = lmdb_env.open_env(path, readonly=True, lock=False)
    try:
        db = env.open_db(b"segments", create=False)
        txn = env.begin(db=db)
        for seg_id in range(first_id, last_id + 1):
            try:
                record = txn.get(U64.pack(seg_id))
            except lmdb_env.Error:
                record = b""  # this id's page is damaged: unreadable, not absent
                txn.abort()  # an error leaves the transaction unusable: take a new one
                txn = env.begin(db=db)
            conn.send((seg_id, None if record is None else bytes(record)))
        txn.abort()
    finally:
        env.close()
    conn.send(None)


def _salvage_names(env, holders_db, count: int) -> dict[int, str | None]:
    """Each holder name by its own key, so that one damaged entry costs one name."""
    found: dict[int, tuple[bytes, bytes | None] | None] = {}
    txn = env.begin(db=holders_db)
    try:
        for holder_id in range(count):
            packed = HOLDER_ID.pack(holder_id)
            try:
                value, stored = txn.get(b"i:" + packed), txn.get(b"s:" + packed)
            except lmdb_env.Error:
                txn.abort()
                txn = env.begin(db=holders_db)
                found[holder_id] = None
                continue
            if value is not None:
                found[holder_id] = (bytes(value), None if stored is None else bytes(stored))
    finally:
        txn.abort()
    # An index written before name checksums has none at all; otherwise one is required.
    sums = any(f is not None and f[1] is not None for f in found.values())
    return {holder_id: None if entry is None else checked_name(entry[0], entry[1], sums)
            for holder_id, entry in found.items()}


def salvage_meta(path: str, conn) -> None:
    """Send ``(counters, holder names)`` read without trusting anything: for repair."""
    env = lmdb_env.open_env(path, readonly=True, lock=False)
    try:
        out: dict = {"next_seg_id": None, "names": {}}
        meta = None
        try:
            meta = env.open_db(b"meta", create=False)
            with env.begin(db=meta) as txn:
                raw = txn.get(b"next_seg_id")
                out["next_seg_id"] = U64.unpack(raw)[0] if raw else None
        except lmdb_env.Error:
            pass
        try:
            holders = env.open_db(b"holders", create=False)
            with env.begin() as txn:
                raw = txn.get(b"next_holder_id", db=meta)
            count = U64.unpack(raw)[0] if raw else MAX_HOLDERS
            out["names"] = _salvage_names(env, holders, min(count, MAX_HOLDERS))
        except lmdb_env.Error:
            pass
        conn.send(out)
    finally:
        env.close()


