"""The store on LMDB (a folder): :mod:`sarp.store`'s contract, on the environment
:mod:`sarp.lmdb_env` (lmdb's door) opens.  The contract's tables (``sarp.store.TABLES``)
are named LMDB databases in ``data.mdb``, with the keys and values :mod:`sarp.store`
gives.  Here: the environment and its locks (``sarp.lock`` and a lock on ``data.mdb``),
map growth, checks of the file before LMDB maps it and a writer's cover of a file cut
short, a writer's aliases in memory over their dump and journal (:mod:`sarp.aliastable`),
and lmdb's errors translated to :mod:`sarp.errors` (here and nowhere else; the salvage
readers of :mod:`sarp.repair` are :mod:`sarp.salvage`).
"""

from __future__ import annotations

import os
import struct
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import TypeVar

import numpy as np

from . import lmdb_env
from . import snapshot as snapshots
from .aliastable import Aliases
from .errors import (
    CorruptRecordError,
    DamagedIndexError,
    IndexLockedError,
    NotAnIndexError,
    StoreError,
    StoreFullError,
)
from .folder import (
    REPAIR_HINT,
    check_data_file,
    check_readable,
    cover_last_page,
    no_room,
    readers_full,
    take_data_lock,
    take_folder,
)
from .segment import Segment, decode, writable
from .store import (
    BLOCK_DTYPE,
    BLOCK_VALUE,
    DEFAULT_MAX_READERS,
    FORMAT_VERSION,
    LOG_VALUE,
    TABLES,
    U64,
    Capabilities,
    WriteLogic,
    alias_columns,
    check_durability,
    check_int,
    check_version,
    counter_value,
    hash_keys,
    holder_names,
    log_arrays,
)

MAX_GROWTHS = 40  # map doublings for one write: from 1 MiB that is past any disk
T = TypeVar("T")

# u16 LE offsets, prepacked; a segment holds at most sarp.index.MAX_SEGMENT_BLOCKS (4,096)
_OFFSETS = [struct.pack("<H", offset) for offset in range(4096)]


def _block_items(hashes: np.ndarray, seg_id: int,
                 first_offset: int) -> Iterator[tuple[bytes, bytes]]:
    """``blocks`` entries placing ``hashes`` at ``seg_id`` from ``first_offset`` on; the
    values are made by ``map`` over prepacked offsets (C, no Python per block)."""
    prefix = struct.pack("<I", seg_id)
    values = map(prefix.__add__, _OFFSETS[first_offset : first_offset + hashes.size])
    return zip(hash_keys(hashes), values, strict=True)


class LmdbStore:
    """An LMDB environment holding one sarp index, owned by one process at a time.

    Cost: opening is O(1) (LMDB maps the file; nothing is read up front).
    """

    # records and lookups are pages of this process's map: about a microsecond each
    capabilities = Capabilities(local_reads=True, prefetch=False)
    maybe_applied = False  # a commit that fails is not applied

    def __init__(self, path: str | os.PathLike, *, durability: str = "sync",
                 map_size_bytes: int = 1 << 36, create: bool = True, readonly: bool = False,
                 max_readers: int = DEFAULT_MAX_READERS) -> None:
        check_durability(durability)
        check_int("map_size_bytes", map_size_bytes, 1 << 20, 1 << 62)
        check_int("max_readers", max_readers, 1, 1 << 16)
        self.path = Path(path)
        self.durability = durability
        self.readonly = readonly
        self.max_readers = max_readers
        self.alias_memory = Aliases()  # a writer's aliases (read at its first write)
        self._lock_fd = None
        if readonly:
            check_readable(self.path)
        else:
            self._lock_fd = take_folder(self.path, create)
        try:
            check_data_file(self.path / "data.mdb")
        except BaseException:
            self._release_lock()
            raise
        try:
            self.env = lmdb_env.open_env(str(self.path), map_size=map_size_bytes,
                                         max_readers=max_readers, durability=durability,
                                         readonly=readonly)
            if readonly:
                self._open_tables_readonly()
            else:
                self._data_lock_fd = take_data_lock(self.path / "data.mdb")
                cover_last_page(self.path / "data.mdb")  # a file cut short: damage, not SIGBUS
                for name in TABLES:
                    setattr(self, f"{name}_db", self.env.open_db(name.encode()))
                self._init_meta()
                self.release_dead_readers()  # slots a killed process left pin pages
        except lmdb_env.ReadersFullError as exc:
            self.close()
            raise readers_full(self.path, self.max_readers, exc) from exc
        except lmdb_env.Error as exc:
            self.close()
            if "already open in this process" in str(exc):
                raise IndexLockedError(
                    f"{self.path} is already open in this process, and LMDB allows one open "
                    "per process; share that Index object (its calls are thread-safe), or "
                    "open it readonly=True from another process") from exc
            raise NotAnIndexError(f"{self.path}: not an LMDB environment: {exc}") from exc
        except BaseException:
            self.close()
            raise

    # -- lifecycle -------------------------------------------------------------------------

    def _init_meta(self) -> None:
        with self.env.begin(write=True) as txn:
            w = LmdbWriteTxn(self, txn)
            version = txn.get(b"format_version", db=self.meta_db)
            if version is None:
                if txn.stat(self.segments_db)["entries"]:
                    raise NotAnIndexError(f"{self.path}: LMDB data without sarp metadata")
                w.create_meta()
            self.format_version = check_version(txn.get(b"format_version", db=self.meta_db),
                                                self.path)
            if self.format_version < FORMAT_VERSION:
                self._upgrade_aliases(txn)
            self.index_id = bytes(txn.get(b"index_id", db=self.meta_db))
            if txn.get(b"name_sums", db=self.meta_db) is None:
                w.add_missing_name_sums()

    def _upgrade_aliases(self, txn: lmdb_env.Transaction) -> None:
        """Format 1 kept an entry per alias (root + hash -> key, BE); 2 keeps a dump and
        a journal (:mod:`sarp.aliastable`).  Cost: a Python step per alias, once."""
        roots, hashes, keys = alias_columns(txn.cursor(db=self.aliases_db), self.path,
                                            REPAIR_HINT.format(path=self.path))
        if keys.size:
            self.alias_memory.load([])
            self.alias_memory.put(roots, hashes, keys)
            txn.drop(self.aliases_db, delete=False)
            txn.cursor(db=self.aliases_db).putmulti(self.alias_memory.dump(), append=True)
            self.alias_memory.forget()
        txn.put(b"format_version", U64.pack(FORMAT_VERSION), db=self.meta_db)
        self.format_version = FORMAT_VERSION

    def _open_tables_readonly(self) -> None:
        """Open the named tables without creating anything (a reader writes nothing)."""
        try:
            for name in TABLES[:-1]:  # not aliases: only a writer reads them
                # Without txn=, py-lmdb opens each table in a read transaction of its
                # own and keeps the handle; a handle opened in our txn would not last.
                setattr(self, f"{name}_db", self.env.open_db(name.encode(), create=False))
        except lmdb_env.NotFoundError:
            raise NotAnIndexError(
                f"{self.path}: no {name!r} table: not an index yet, or one written before "
                f"that table was; open it once without readonly=True to add it") from None
        with self._begin() as txn:
            version = txn.get(b"format_version", db=self.meta_db)
            if version is None:
                raise NotAnIndexError(f"{self.path}: no sarp metadata; not an index yet")
            self.format_version = check_version(version, self.path)
            self.index_id = bytes(txn.get(b"index_id", db=self.meta_db))

    def raw_reads(self) -> tuple | None:
        """What C reads ``segments`` and ``meta`` with in read transactions of its own
        (``lmdb_env.raw_reads``), or None."""
        return lmdb_env.raw_reads(self.env, (b"segments", b"meta"))

    def _begin(self, **kwargs) -> lmdb_env.Transaction:
        """A read transaction; adopts a map the writer grew, names a full reader table."""
        for _ in range(3):
            try:
                return self.env.begin(**kwargs)
            except lmdb_env.MapResizedError:
                self.env.set_mapsize(0)  # 0: take the size the writer set
            except lmdb_env.ReadersFullError as exc:
                raise readers_full(self.path, self.max_readers, exc) from exc
        return self.env.begin(**kwargs)

    def close(self) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            env.close()
            self.env = None
        self._release_lock()

    def _release_lock(self) -> None:
        for name in ("_lock_fd", "_data_lock_fd"):
            if getattr(self, name, None) is not None:
                os.close(getattr(self, name))
                setattr(self, name, None)

    def load_snapshot(self) -> snapshots.Snapshot:
        """The directory snapshot beside the data (``SnapshotUnusable`` says why not)."""
        return snapshots.load(self.path)

    def save_snapshot(self, watermark: int, directory, holders) -> int:
        """Write the directory snapshot file atomically; return its size."""
        return snapshots.write(self.path, self.index_id, watermark, directory, holders)

    def load_state(self, name: str) -> bytes | None:
        """A named value of the ``state`` table (``sarp serve``'s resume point), or None."""
        with self._begin() as txn:
            value = txn.get(name.encode(), db=self.state_db)
        return None if value is None else bytes(value)

    def save_state(self, name: str, data: bytes, durable: bool) -> None:
        """Replace the named value in a write of its own (fsync'ed when ``durable``)."""
        self.write(lambda w: w.put_state(name, data))
        if durable and self.durability != "sync":
            self.env.sync(True)

    def files(self) -> list[Path]:
        """The LMDB files of this index (for size accounting and cache eviction)."""
        return [self.path / "data.mdb", self.path / "lock.mdb"]

    def release_dead_readers(self) -> int:
        """Free dead readers' slots (their pages stay pinned); how many.  A lock probe each."""
        return self.env.reader_check() if self.env is not None else 0

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files() if p.exists())

    def memory_bytes(self) -> int:
        """A writer's aliases (:mod:`sarp.aliastable`), once its first write read them."""
        return self.alias_memory.nbytes

    # -- transactions ----------------------------------------------------------------------

    def read(self) -> LmdbReadTxn:
        """A short read transaction: ``with store.read() as r: r.segment(7)``."""
        return LmdbReadTxn(self)

    def write(self, fn: Callable[[LmdbWriteTxn], T]) -> T:
        """Run ``fn`` in one write transaction and commit it; all or nothing.

        On ``MapFullError`` the transaction is aborted, the map is doubled outside
        any transaction, and ``fn`` runs again from the start.
        """
        for _ in range(MAX_GROWTHS):
            try:
                try:
                    with self.env.begin(write=True) as txn:
                        return fn(LmdbWriteTxn(self, txn))
                except BaseException:
                    self.alias_memory.forget()  # what the aborted write changed in memory
                    raise
            except lmdb_env.MapFullError:
                self._grow()
            except lmdb_env.Error as exc:
                # LMDB reports a full disk as a failed write (often EIO): the caller gets
                # StoreFullError; the transaction was aborted, the index is as it was.
                room = no_room(self.path)
                if room is not None:
                    raise StoreFullError(f"{self.path}: the write failed ({exc}): {room}; "
                                         "the index is unchanged") from exc
                raise StoreError(f"{self.path}: write failed: {exc}") from exc
        raise StoreFullError(f"{self.path}: the map grew {MAX_GROWTHS} times and one write "
                             "still does not fit; open with a larger map_size_bytes")

    def _grow(self) -> None:
        new_size = self.env.info()["map_size"] * 2
        try:
            self.env.set_mapsize(new_size)
        except lmdb_env.Error as exc:
            raise StoreFullError(f"{self.path}: cannot grow map to {new_size} B: {exc}") from exc

    def counter(self, name: str) -> int:
        with self._begin() as txn:
            return counter_value(txn.get(name.encode(), db=self.meta_db), name, self.path)

    def trim_log(self, upto: int) -> None:
        """Delete log entries with sequence <= ``upto`` (a durable snapshot covers them)."""

        def trim(w: LmdbWriteTxn) -> None:
            cur = w.txn.cursor(db=self.log_db)
            if cur.last() and U64.unpack(cur.key())[0] <= upto:  # all of it: one call
                w.txn.drop(self.log_db, delete=False)  # (a delete each: 32 ms for 60,000)
            elif cur.first():
                while cur.key() and U64.unpack(cur.key())[0] <= upto:
                    if not cur.delete():
                        break
            w.set_counter("log_trimmed_upto", max(upto, w.counter("log_trimmed_upto")))

        self.write(trim)


class LmdbReadTxn:
    """One consistent view of the store, for ``match`` (segment records, counted as
    reads) and for a reader keeping its directory current (counters, the log, holder
    names), all in the same LMDB read transaction."""

    __slots__ = ("_store", "_txn", "reads")
    capabilities = LmdbStore.capabilities

    @property
    def native_get(self):
        """The LMDB transaction's own ``get`` (key: big-endian u64 segment id), for a
        walk in C; reads through it are counted by the caller."""
        return self._txn.get

    def prefetch(self, keys: list[bytes], with_counters: bool = False) -> None:
        """Nothing to fetch ahead: records are local (``capabilities.prefetch`` is False)."""

    def forget_prefetched(self) -> None:
        """Nothing is fetched ahead."""

    def __init__(self, store: LmdbStore) -> None:
        self._store = store
        self._txn = None
        self.reads = 0

    def __enter__(self) -> LmdbReadTxn:
        self._txn = self._store._begin(db=self._store.segments_db)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._txn.abort()
        self._txn = None
        if exc_type is not None and issubclass(exc_type, lmdb_env.Error):
            # A damaged page met while reading: sarp's error, naming the file, not lmdb's.
            raise DamagedIndexError(
                f"{self._store.path / 'data.mdb'}: reading failed ({exc_type.__name__}: {exc}); "
                f"the file is damaged. {REPAIR_HINT.format(path=self._store.path)}"
            ) from exc

    def record(self, seg_id: int) -> bytes | None:
        """The raw record of a segment (checked by the caller), counted as one read."""
        self.reads += 1
        return self._txn.get(U64.pack(seg_id))

    def segment(self, seg_id: int) -> Segment | None:
        """The decoded segment (not counted as a match read)."""
        record = self._txn.get(U64.pack(seg_id))
        return None if record is None else decode(seg_id, record)

    def raw_records(self, seg_ids: list[int]) -> list[bytes | None]:
        """The unchecked records of many segments, in order (not counted as match reads)."""
        get = self._txn.get
        return [get(key) for key in map(U64.pack, seg_ids)]

    def counter(self, name: str) -> int:
        raw = self._txn.get(name.encode(), db=self._store.meta_db)
        return counter_value(raw, name, self._store.path)

    def index_id(self) -> bytes | None:
        """The id the index was created with, as of this transaction."""
        raw = self._txn.get(b"index_id", db=self._store.meta_db)
        return None if raw is None else bytes(raw)

    def log_since(self, seq: int) -> Iterator[tuple[int, int, int]]:
        """(seq, segment id, first hash) for log entries with sequence > ``seq``."""
        yield from zip(*(a.tolist() for a in self.log_arrays(seq)), strict=True)

    def log_arrays(self, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`log_since` as arrays (:func:`sarp.store.log_arrays`)."""
        cur = self._txn.cursor(db=self._store.log_db)
        return log_arrays(list(cur.iternext()) if cur.set_range(U64.pack(seq + 1)) else [])

    def raw_segments(self) -> Iterator[tuple[int, bytes]]:
        for key, record in self._txn.cursor(db=self._store.segments_db):
            if len(key) != U64.size:
                raise CorruptRecordError(f"segments table: a key of {len(key)} bytes")
            yield U64.unpack(key)[0], record

    def blocks(self) -> Iterator[tuple[int, int, int]]:
        for key, value in self._txn.cursor(db=self._store.blocks_db):
            if len(key) != U64.size or len(value) != BLOCK_VALUE.size:
                raise CorruptRecordError(f"blocks table: an entry of {len(key)}+{len(value)} "
                                         "bytes (8+6 expected)")
            seg_id, offset = BLOCK_VALUE.unpack(value)
            yield U64.unpack(key)[0], seg_id, offset

    def holder_names(self) -> dict[int, str | None]:
        """Holder id -> ``instance\\0medium``; ``None`` for one that fails its checksum."""
        required = self._txn.get(b"name_sums", db=self._store.meta_db) is not None
        db = self._store.holders_db
        return holder_names(_items(self._txn.cursor(db=db), b"i:"),
                            lambda packed: self._txn.get(b"s:" + packed, db=db), required)

    def stat(self, table: str) -> dict:
        return self._txn.stat(getattr(self._store, f"{table}_db"))

    def aliases_problems(self) -> list[str]:
        """The ``aliases`` table read as a writer reads it (format 2's dump and journal,
        format 1's entries): a line for its first damage, none when it reads."""
        store = self._store
        try:  # (a reader does not keep the table open: only a writer reads it)
            db = getattr(store, "aliases_db", None) or store.env.open_db(
                b"aliases", txn=self._txn, create=False)
        except lmdb_env.NotFoundError:
            return []  # an index from before the table
        try:
            if store.format_version < FORMAT_VERSION:
                alias_columns(self._txn.cursor(db=db), store.path,
                              REPAIR_HINT.format(path=store.path))
            else:
                Aliases().load(self._txn.cursor(db=db), store.path)
        except DamagedIndexError as exc:
            return [str(exc)]
        return []


class LmdbWriteTxn(WriteLogic):
    """The operations a write needs, inside one LMDB write transaction."""

    __slots__ = ("_store", "txn", "_aliased", "_parent")
    capabilities = LmdbStore.capabilities

    def __init__(self, store: LmdbStore, txn: lmdb_env.Transaction,
                 parent: lmdb_env.Transaction | None = None) -> None:
        self._store = store
        self.txn = txn
        self._aliased = False  # this transaction changed the aliases in memory
        self._parent = parent  # the transaction this one is nested in

    def set_counter(self, name: str, value: int) -> None:
        self.txn.put(name.encode(), U64.pack(value), db=self._store.meta_db)

    def put_meta(self, key: bytes, value: bytes) -> None:
        self.txn.put(key, value, db=self._store.meta_db)

    def put_state(self, name: str, data: bytes) -> None:
        self.txn.put(name.encode(), data, db=self._store.state_db)

    def segment(self, seg_id: int) -> Segment:
        """Segment ``seg_id``, decoded into arrays the write may modify in place."""
        record = self.txn.get(U64.pack(seg_id), db=self._store.segments_db)
        if record is None:
            raise CorruptRecordError(f"blocks table names segment {seg_id}, which is missing")
        return writable(seg_id, record)

    def segment_exists(self, seg_id: int) -> bool:
        return self.txn.get(U64.pack(seg_id), db=self._store.segments_db) is not None

    def put_segment(self, seg: Segment) -> None:
        self.txn.put(U64.pack(seg.seg_id), seg.encode(), db=self._store.segments_db)

    def delete_segment(self, seg: Segment) -> None:
        self.txn.delete(U64.pack(seg.seg_id), db=self._store.segments_db)
        self.release_blocks(seg.hashes)

    def locate(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Segment id and offset of each hash (segment id 0 where absent): one cursor call."""
        seg_ids = np.zeros(hashes.size, dtype=np.uint32)
        offsets = np.zeros(hashes.size, dtype=np.uint16)
        found = self.txn.cursor(db=self._store.blocks_db).getmulti(hash_keys(hashes))
        if found:
            # back to query positions in numpy: keys BE hashes, values (u32 seg, u16 offset)
            got = np.frombuffer(b"".join(map(itemgetter(0), found)), ">u8").astype(np.uint64)
            values = np.frombuffer(b"".join(map(itemgetter(1), found)), dtype=BLOCK_DTYPE)
            order = np.argsort(hashes, kind="stable")
            where = order[np.searchsorted(hashes[order], got)]
            seg_ids[where] = values["seg"]
            offsets[where] = values["off"]
        return seg_ids, offsets

    def locate_one(self, block_hash: int) -> tuple[int, int]:
        """:meth:`locate` for one hash: ``(segment id, offset)``, ``(0, 0)`` if absent
        (one LMDB lookup)."""
        value = self.txn.get(U64.pack(block_hash), db=self._store.blocks_db)
        return (0, 0) if value is None else BLOCK_VALUE.unpack(value)

    def put_blocks(self, hashes: np.ndarray, seg_id: int, first_offset: int) -> None:
        self.txn.cursor(db=self._store.blocks_db).putmulti(
            _block_items(hashes, seg_id, first_offset))

    def claim_blocks(self, hashes: np.ndarray, seg_id: int, first_offset: int) -> bool:
        """:meth:`put_blocks` if none of ``hashes`` is stored; else change nothing and
        return False.

        Cost: as :meth:`put_blocks` (LMDB refuses an existing key in the same descent
        that would insert it); a refusal also reads back and deletes what was added.
        """
        items = _block_items(hashes, seg_id, first_offset)
        _, added = self.txn.cursor(db=self._store.blocks_db).putmulti(items, overwrite=False)
        if added == hashes.size:
            return True
        cur = self.txn.cursor(db=self._store.blocks_db)
        ours = dict(_block_items(hashes, seg_id, first_offset))
        for key, value in cur.getmulti(list(ours)):
            if value == ours[key]:  # no stored entry can name this new place
                self.txn.delete(key, db=self._store.blocks_db)
        return False

    def native_calls(self) -> tuple:
        """What ``sarp._native.pack_batch`` calls of this transaction, in its order:
        a ``blocks`` get and a ``segments`` get (big-endian keys), the checked read of
        a segment (to name damage), a new segment id, the return of ids from one on
        (taken by an insert that then fell to Python), a holder's id (None if it has
        none), a new holder's id (None when every id is taken and one must be
        reclaimed), the transaction's ``put`` and ``delete`` (called with a table),
        the ``segments`` and ``blocks`` tables, and a ``blocks`` cursor's ``put``,
        ``set_key`` and ``pop`` (a deferred batch's writes, in key order)."""
        blocks_db, segments_db = self._store.blocks_db, self._store.segments_db
        txn = self.txn
        blocks = txn.cursor(db=blocks_db)
        return (blocks.get, txn.cursor(db=segments_db).get, self.segment, self.new_segment_id,
                self.untake_segment_ids,
                lambda name: self.holder_id(name, create=False), self.new_holder_id,
                txn.put, txn.delete, segments_db, blocks_db, blocks.put, blocks.set_key,
                blocks.pop)

    def raw_tables(self) -> tuple | None:
        """What C reads and writes ``blocks`` and ``segments`` with in place of the
        methods :meth:`native_calls` names (``lmdb_env.raw_tables``), or None."""
        return lmdb_env.raw_tables(self.txn, self._store.env, self._parent)

    def nested(self) -> LmdbWriteTxn:
        """A write transaction inside this one (LMDB's nested transaction): what it
        writes joins this one at :meth:`commit` and is gone after :meth:`abort`.  This
        one must not be used until then.

        Cost: its commit merges its dirty pages into this one's: 0.8 ms more for a
        batch of 12,000 puts (docs/performance.md, "Deferred `blocks` writes").
        """
        return LmdbWriteTxn(self._store, self._store.env.begin(write=True, parent=self.txn),
                            self.txn)

    def commit(self) -> None:
        """Commit a :meth:`nested` transaction into its parent."""
        self.txn.commit()

    def abort(self) -> None:
        """Drop a :meth:`nested` transaction and everything it wrote."""
        self.txn.abort()
        if self._aliased:
            self._store.alias_memory.forget()

    def release_blocks(self, hashes: np.ndarray) -> None:
        """Delete the ``blocks`` entries of ``hashes`` (consumed in C: no Python per block)."""
        deque(map(partial(self.txn.delete, db=self._store.blocks_db), hash_keys(hashes)),
              maxlen=0)

    def log(self, entries: list[tuple[int, int]]) -> None:
        """Append ``(segment id, first hash)`` entries to the log (one appending putmulti)."""
        first = self.take_seqs(len(entries))
        self.txn.cursor(db=self._store.log_db).putmulti(
            [(U64.pack(first + i), LOG_VALUE.pack(seg_id, first_hash))
             for i, (seg_id, first_hash) in enumerate(entries)], append=True)

    def holder_get(self, key: bytes) -> bytes | None:
        return self.txn.get(key, db=self._store.holders_db)

    def holder_put(self, key: bytes, value: bytes | None) -> None:  # None: delete
        if value is None:
            self.txn.delete(key, db=self._store.holders_db)
        else:
            self.txn.put(key, value, db=self._store.holders_db)

    def holder_items(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The holders table's entries whose keys start with ``prefix``, in key order."""
        return _items(self.txn.cursor(db=self._store.holders_db), prefix)

    def _aliases(self) -> Aliases:
        memory = self._store.alias_memory
        if not memory.loaded:
            memory.load(self.txn.cursor(db=self._store.aliases_db), self._store.path)
        return memory

    def alias_get(self, root: int, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The store contract's ``alias_get``, from the writer's table in memory."""
        return self._aliases().get(root, hashes)

    def alias_put(self, roots: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        if hashes.size:  # (a batch whose aliases are all known already: no record)
            self._journal(self._aliases().put(roots, hashes, keys))

    def alias_delete(self, roots: np.ndarray, hashes: np.ndarray) -> None:
        if hashes.size:
            self._journal(self._aliases().delete(roots, hashes))

    def alias_scan(self, cursor: int | None, count: int):
        return self._aliases().scan(cursor, count)

    def _journal(self, record: tuple[bytes, bytes]) -> None:
        """Append a change's record; past the journal's bound, the dump in its place."""
        memory, db = self._store.alias_memory, self._store.aliases_db
        self._aliased = True
        self.txn.put(*record, db=db, append=True)
        if memory.compaction_due():
            self.txn.drop(db, delete=False)
            self.txn.cursor(db=db).putmulti(memory.dump(), append=True)

    def counter(self, name: str) -> int:
        raw = self.txn.get(name.encode(), db=self._store.meta_db)
        return counter_value(raw, name, self._store.path)


def _items(cur, prefix: bytes) -> list[tuple[bytes, bytes]]:
    """A cursor's entries whose keys start with ``prefix``, in key order."""
    out = []
    if cur.set_range(prefix):
        for key, value in cur:
            if not key.startswith(prefix):
                break
            out.append((bytes(key), bytes(value)))
    return out
