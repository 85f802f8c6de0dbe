"""The public index: ``sarp.open(path)`` returns an :class:`Index`.

How the parts meet:

* ``insert`` runs one LMDB write transaction: it finds the blocks already stored
  (``blocks`` table), sets the holder's presence bits on their segments, and packs
  each run of new blocks after its parent, filling the parent's segment when the
  parent is its last block and it has room, else starting new segments of up to
  ``segment_blocks`` blocks.  Only after the commit does it touch memory (directory
  entries for new segments, holder filters).  So a failed insert changes nothing.
* ``match`` walks the query one segment at a time: one directory probe and one
  LMDB read per step, verified in numpy (:mod:`sarp.verify`).
* ``snapshot`` writes the directory and filters with the log watermark; ``open``
  loads it and replays the log entries after the watermark, or rebuilds from the
  segments when the snapshot is missing, stale or damaged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from . import native
from . import snapshot as snapshots
from .check import check
from .directory import Directory
from .errors import (
    CorruptRecordError,
    IndexClosedError,
    LeaseLostError,
    ReadOnlyIndexError,
    StoreError,
)
from .filters import HolderSegments
from .hashing import HashesLike, as_hash, as_hashes, repeats
from .packing import Packer, Plan
from .segment import decode
from .segment import head as segment_head
from .store import DEFAULT_MAX_READERS, ReadTxn, Store, is_url, open_store
from .verify import Match, PrefixWalk, examine, examine_py

log = logging.getLogger("sarp")

DEFAULT_SEGMENT_BLOCKS = 1024
MAX_SEGMENT_BLOCKS = 4096
DEFAULT_MEDIUM = "GPU"
_SEP = "\0"
_U64_LE = struct.Struct("<Q")
_LONG_CHAIN = 256  # blocks: match_many walks longer chains one at a time


class _LogHole(Exception):
    """Entries are missing from the log after the watermark: memory cannot be brought
    up to date from it (a reader reloads, a writer's open rebuilds)."""


@dataclass(slots=True)
class _Counters:
    inserts: int = 0
    inserted_blocks: int = 0
    matches: int = 0
    matched_blocks: int = 0
    storage_reads: int = 0
    removes: int = 0
    removed_blocks: int = 0
    remove_missing: int = 0
    clears: int = 0
    snapshots: int = 0
    changes_since_snapshot: int = 0
    corrupt_records: int = 0  # damaged segment records a match stopped at
    batches: int = 0  # apply_batch / batch() commits
    batched_ops: int = 0  # operations they carried
    snapshot_reloads: int = 0  # a reader found the log trimmed past it and reloaded
    reader_rebuilds: int = 0  # ... and had no usable snapshot: rebuilt in memory
    log_holes: int = 0  # a reader found entries missing from the log, and reloaded
    index_reloads: int = 0  # a reader found the index created anew, and reloaded


def open(  # noqa: A001 - the public name the design asks for
    path: str | os.PathLike,
    *,
    segment_blocks: int = DEFAULT_SEGMENT_BLOCKS,
    durability: str = "sync",
    snapshot_every_changes: int = 200_000,
    map_size_bytes: int = 1 << 36,
    create: bool = True,
    progress: bool | None = None,
    readonly: bool = False,
    max_readers: int = DEFAULT_MAX_READERS,
    lease_s: float = 10.0,
    wait_for_lease_s: float = 0.0,
) -> Index:
    """Open (creating, or recovering after a restart or crash) the index at ``path``.

    ``path`` is a folder (LMDB files), or ``"valkey://HOST:PORT/NAMESPACE"`` (also
    ``redis://``, and ``rediss://`` or ``valkeys://`` with TLS; a password in the URL
    or ``$SARP_VALKEY_PASSWORD``) for an index shared by many machines, with the same
    calls and guarantees (:mod:`sarp.store_valkey`).  On Valkey one writer at a time
    holds a lease of ``lease_s`` seconds, renewed while it runs; another writer is
    refused with ``IndexLockedError``, or with ``wait_for_lease_s`` waits that long
    to take over from one that stopped renewing (it died).

    ``segment_blocks`` (S): most blocks packed into one record. ``durability``:
    ``"sync"`` (default) fsyncs every write, so a returned call survives power
    loss; ``"nosync"`` survives a crash of the process but not of the machine.
    ``snapshot_every_changes``: write a snapshot after this many segment changes
    (and always at ``close``).  ``progress``: show a bar during a rebuild (default:
    when stderr is a terminal).

    ``readonly=True`` opens an existing index as a reader, in any number of
    processes beside one writer (an ``Index`` or ``sarp serve``) or none: it takes
    no lock and writes nothing; each ``match`` first reads the log entries the
    writer committed since the last one, in the same LMDB read transaction as the
    match, so every answer is one consistent state and sees every write that has
    returned in the writer.  Writes on a reader raise ``ReadOnlyIndexError``.
    ``max_readers``: LMDB's reader table, set by the first process to open the
    index (every open process takes a slot).

    Cost: loads the snapshot memory-mapped and replays the log after it; without a
    usable snapshot, one scan of every segment (a reader does it in memory only).

    >>> import tempfile, sarp
    >>> with sarp.open(tempfile.mkdtemp()) as index:
    ...     _ = index.insert([11, 12, 13], holder="w0")
    ...     index.match([11, 12, 99]).num_blocks
    2
    """
    return Index(
        path,
        segment_blocks=segment_blocks,
        durability=durability,
        snapshot_every_changes=snapshot_every_changes,
        map_size_bytes=map_size_bytes,
        create=create,
        progress=progress,
        readonly=readonly,
        max_readers=max_readers,
        lease_s=lease_s,
        wait_for_lease_s=wait_for_lease_s,
    )


class Index:
    """An on-SSD KV-cache prefix index. Use :func:`sarp.open` to get one."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        segment_blocks: int,
        durability: str,
        snapshot_every_changes: int,
        map_size_bytes: int,
        create: bool,
        progress: bool | None,
        readonly: bool = False,
        max_readers: int = DEFAULT_MAX_READERS,
        lease_s: float = 10.0,
        wait_for_lease_s: float = 0.0,
    ) -> None:
        _check_int("segment_blocks", segment_blocks, 1, MAX_SEGMENT_BLOCKS)
        _check_int("snapshot_every_changes", snapshot_every_changes, 1, 1 << 62)
        started = time.perf_counter()
        self.path = path if is_url(path) else Path(path)
        self._packer = Packer(segment_blocks, self.path, reclaim=self._reclaim_holder_id,
                              heads=lambda first_hash: self.directory.lookup(first_hash),
                              probe=lambda: (self.directory.lookup,
                                             *self.directory.probe_dicts()))
        self.snapshot_every_changes = snapshot_every_changes
        self._progress = progress
        self._lock = threading.RLock()
        self._counters = _Counters()
        self._match_observers: list[Callable[[np.ndarray], None]] = []
        self.readonly = readonly
        self._watermark = 0  # the log sequence memory reflects (readers keep it current)
        self._store = open_store(path, durability=durability, create=create,
                                 readonly=readonly, map_size_bytes=map_size_bytes,
                                 max_readers=max_readers, lease_s=lease_s,
                                 wait_for_lease_s=wait_for_lease_s)
        try:
            with self._store.read() as r:
                self._load_holders(r.holder_names())
                self._holders_seen = _holders_version(r)
                self._recover(r)
            if self._damaged_holders and not readonly:
                self._drop_damaged_holders()
        except BaseException:
            self._store.close()
            self._store = None
            raise
        self.recovery_s = time.perf_counter() - started

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Write a snapshot if anything changed since the last one, and release the files.

        Safe to call twice.  After ``close`` every other call raises ``IndexClosedError``.
        """
        with self._lock:
            if self._store is None:
                return
            try:
                if not self.readonly and (self._counters.changes_since_snapshot
                                          or not self._snapshot_present):
                    self.snapshot()
            except LeaseLostError as exc:
                # Another writer owns the index now; its snapshots are the ones that count.
                log.warning("sarp: closing without a snapshot: %s", exc)
            finally:
                self._store.close()
                self._store = None

    @property
    def segment_blocks(self) -> int:
        """S: the most blocks packed into one record (new segments; old ones keep theirs)."""
        return self._packer.segment_blocks

    @property
    def closed(self) -> bool:
        return self._store is None

    @property
    def multi_medium(self) -> bool:
        """Does some instance hold blocks in two media (as of this process's last look
        at the store)?  ``Match.multi_medium`` says it for one answer."""
        return self._multi_medium

    def _live_store(self) -> Store:
        if self._store is None:
            raise IndexClosedError(f"{self.path}: the index is closed; open it again")
        return self._store

    def _writable_store(self, operation: str) -> Store:
        store = self._live_store()
        if self.readonly:
            raise ReadOnlyIndexError(
                f"{self.path}: {operation} on an index opened readonly=True; writes go through "
                "the one writer (sarp serve, or sarp.open without readonly)"
            )
        return store

    # -- recovery --------------------------------------------------------------------------

    def _load_holders(self, names: dict[int, str | None]) -> None:
        # A name that fails its checksum is left out: its blocks count for num_blocks
        # (someone holds them) but are never reported under a name (check() says so).
        self._damaged_holders = sorted(h for h, name in names.items() if name is None)
        if self._damaged_holders:
            log.error("sarp: holder names %s fail their checksums; their blocks are not "
                      "reported per holder (sarp verify names them)", self._damaged_holders)
        top = max(names, default=-1)
        names = {h: name for h, name in names.items() if name is not None}
        self._holder_names: dict[int, tuple[str, str]] = {}
        self._instances: dict[str, int] = {}
        self._instance_names: list[str] = []
        self._instance_of: list[int] = []
        self._multi_medium = False  # does any instance hold blocks in two media?
        for holder_id, name in sorted(names.items()):
            self._register_holder(holder_id, name)
        self._instance_of.extend([-1] * (top + 1 - len(self._instance_of)))

    def _register_holder(self, holder_id: int, name: str) -> None:
        instance, medium = name.split(_SEP, 1)
        self._holder_names[holder_id] = (instance, medium)
        inst = self._instances.setdefault(instance, len(self._instance_names))
        if inst == len(self._instance_names):
            self._instance_names.append(instance)
        else:
            self._multi_medium = True
        if holder_id >= len(self._instance_of):
            self._instance_of.extend([-1] * (holder_id + 1 - len(self._instance_of)))
        self._instance_of[holder_id] = inst

    def _recover(self, r: ReadTxn) -> None:
        """Load the snapshot and replay the log after it, or rebuild; all as of ``r``."""
        self.recovered_from = "new" if r.stat("segments")["entries"] == 0 else "rebuild"
        self.recovery_reason = ""
        self.replayed_changes = 0
        try:
            snap = self._store.load_snapshot()
            problem = self._stale_reason(snap, r)
            if problem:
                raise snapshots.SnapshotUnusable(problem)
        except snapshots.SnapshotUnusable as exc:
            self._snapshot_present = False
            if self.recovered_from == "rebuild":  # a new, empty index needs no reason
                self.recovery_reason = str(exc)
                # A reader builds in memory and writes nothing: routine, not a warning.
                (log.info if self.readonly else log.warning)(
                    "sarp: %s; rebuilding the directory from the segments", exc)
            self._rebuild(r)
            return
        self._snapshot_present = True
        self.directory, self.holders = snap.directory, snap.holders
        self.recovered_from = "snapshot"
        self._watermark = snap.watermark
        try:
            self.replayed_changes = self._replay_log(r)
        except _LogHole as exc:
            self.recovered_from, self.recovery_reason = "rebuild", str(exc)
            (log.info if self.readonly else log.warning)(
                "sarp: %s: %s; rebuilding the directory from the segments", self.path, exc)
            self._rebuild(r)
            return
        self._counters.changes_since_snapshot = self.replayed_changes

    def _drop_damaged_holders(self) -> None:
        """Clear the blocks of holders whose names fail their checksums (the writer, at
        open): nobody could clear them by name, and they must not count as held."""
        ids = list(self._damaged_holders)

        def repair(w):
            plan = self._packer.clear(w, ids, self.holders)
            w.forget_holders(ids)  # the engine's next store under its name gets a new id
            return plan

        plan = self._store.write(repair)
        self._apply(plan)
        self._damaged_holders = []
        log.error("sarp: cleared %d blocks of holders %s, whose names are damaged, and "
                  "forgot the names", plan.removed_blocks, ids)

    def _stale_reason(self, snap: snapshots.Snapshot, r: ReadTxn) -> str:
        if snap.index_id != self._store.index_id:
            return "snapshot belongs to another index"
        if snap.watermark < r.counter("log_trimmed_upto"):
            return f"snapshot watermark {snap.watermark} is older than the trimmed log"
        if snap.watermark > r.counter("next_seq"):
            return f"snapshot watermark {snap.watermark} is ahead of the store"
        return ""

    def _replay_log(self, r: ReadTxn) -> int:
        """Apply the log entries after the watermark, as of ``r``; return how many.

        A segment logged several times is re-read once: replaying reads its state as
        of ``r``, which is the same for every entry of it.  Entries run on from the
        watermark without a hole; one missing (a stream trimmed by another client)
        raises :class:`_LogHole` before memory changes, and the caller reloads.
        """
        # segment id -> every first hash logged for it: an id can name another chain
        # once its segment is gone (a tail's id is taken again)
        latest: dict[int, list[int]] = {}
        count, last = 0, self._watermark
        for seq, seg_id, first_hash in r.log_since(self._watermark):
            if seq != last + 1:
                raise _LogHole(f"log entry {last + 1} is missing (the next is {seq})")
            logged = latest.pop(seg_id, [])  # keep the order of last mention
            if first_hash not in logged:
                logged.append(first_hash)
            latest[seg_id] = logged
            last = seq
            count += 1
        newest = r.counter("next_seq")
        if last < newest:
            raise _LogHole(f"log entries {last + 1}..{newest} are missing")
        self._replay(r, latest)
        self._watermark = max(last, newest)
        return count

    def _replay(self, r: ReadTxn, latest: dict[int, list[int]]) -> None:
        """Bring the directory and the holder filters to the state of ``r`` for the
        segments in ``latest`` (segment id -> the first hashes logged for it): the
        entry of each hash the id no longer starts with goes, if it names this id.

        Cost: one record read and check per segment (one round trip for them all on a
        remote store), and one bitmap operation per holder, not per segment.
        """
        seg_ids = list(latest)
        self.holders.discard_many_everywhere(seg_ids)
        held: dict[int, list[int]] = {}
        directory = self.directory
        for seg_id, record in zip(seg_ids, r.raw_records(seg_ids), strict=True):
            found = None
            if record is not None:
                try:
                    found = segment_head(seg_id, record)
                except CorruptRecordError as exc:
                    log.warning("sarp: replay skips %s", exc)
            for first_hash in latest[seg_id]:
                if found is None or first_hash != found[0]:
                    directory.remove(first_hash, seg_id)
            if found is None:
                continue
            directory.add(found[0], seg_id)
            for holder_id in found[1]:
                held.setdefault(holder_id, []).append(seg_id)
        for holder_id, segs in held.items():
            self.holders.add_many(holder_id, segs)

    def _catch_up(self, r: ReadTxn) -> bool:
        """A reader: bring memory to the state of ``r``.  False: retry with a newer ``r``.

        Cost: two meta reads (the index id, the log's counter) when nothing changed;
        else one segment read per changed segment, or a snapshot load when the writer
        trimmed the log past us, the log has a hole, or the index was created anew.
        """
        index_id = r.index_id()
        renewed = index_id != self._store.index_id
        seq = r.counter("next_seq")
        if seq == self._watermark and not renewed:
            return True
        if renewed or _holders_version(r) != self._holders_seen:
            self._load_holders(r.holder_names())
            self._holders_seen = _holders_version(r)
        if renewed:
            # Made anew under us (a Valkey that restarted empty and was written again):
            # its counters can land where ours stood, so they prove nothing.
            log.warning("sarp: %s was created anew since this reader caught up; reloading",
                        self.path)
            old_id, self._store.index_id = self._store.index_id, index_id
            if not self._reload(r, seq):
                self._store.index_id = old_id  # the next attempt sees it anew again
                return False
            self._counters.index_reloads += 1
            return True
        if r.counter("log_trimmed_upto") > self._watermark:
            return self._reload(r, seq)
        try:
            self._replay_log(r)
        except _LogHole as exc:
            log.warning("sarp: %s: %s; reloading", self.path, exc)
            self._counters.log_holes += 1
            return self._reload(r, seq)
        return True

    def _reload(self, r: ReadTxn, seq: int) -> bool:
        """A reader: memory from the snapshot and the log after it, or a rebuild in
        memory when the snapshot cannot be used.  False: retry with a newer ``r``."""
        try:
            snap = self._store.load_snapshot()
        except snapshots.SnapshotUnusable:
            snap = None
        if snap is not None and snap.watermark > seq:
            return False  # a snapshot newer than this transaction: take a newer one
        if snap is None or self._stale_reason(snap, r):
            self._rebuild(r)  # in memory only
            self._counters.reader_rebuilds += 1
            return True
        self.directory, self.holders = snap.directory, snap.holders
        self._watermark = snap.watermark
        self._counters.snapshot_reloads += 1
        try:
            self._replay_log(r)
        except _LogHole:
            self._rebuild(r)
            self._counters.reader_rebuilds += 1
        return True

    def _read(self, query: np.ndarray | None = None) -> contextlib.AbstractContextManager[ReadTxn]:
        """A read transaction, with a reader's memory brought up to it first.

        A writer's memory is always current: its transaction needs no catch-up (and
        no generator around it, a microsecond of every match).  ``query``: the hashes
        about to be matched, so a reader of a remote store can fetch the records its
        directory predicts together with the counters of its catch-up, in one round
        trip.
        """
        return self._reader_read(query) if self.readonly else self._live_store().read()

    @contextmanager
    def _reader_read(self, query: np.ndarray | None) -> Iterator[ReadTxn]:
        store = self._live_store()
        for attempt in range(8):
            with store.read() as r:
                if query is not None and r.capabilities.prefetch:
                    ids = self.directory.lookup_many(query)
                    r.prefetch(ids[ids >= 0], with_counters=True)
                seen = (self._watermark, self._holders_seen, self._counters.index_reloads)
                if self._catch_up(r):
                    now = (self._watermark, self._holders_seen, self._counters.index_reloads)
                    if r.capabilities.prefetch and seen != now:
                        # A remote store's reads are separate commands: read again, so
                        # that the records come from the same atomic read as the
                        # counters this memory is now current with.
                        if attempt < 7:
                            continue
                        r.forget_prefetched()
                    yield r
                    return
        raise StoreError(f"{self.path}: the writer kept replacing its snapshot; try again")

    def _rebuild(self, r: ReadTxn) -> None:
        """Scan every segment (as of ``r``) to rebuild the directory and holder filters."""
        total = r.stat("segments")["entries"]
        keys = np.empty(total, np.uint64)
        segs = np.empty(total, np.uint32)
        by_holder: dict[int, list[int]] = {}
        count = 0
        bar = tqdm(
            r.raw_segments(),
            total=total,
            desc="sarp: rebuilding directory",
            unit="seg",
            disable=None if self._progress is None else not self._progress,
            leave=False,
        )
        for seg_id, record in bar:
            try:
                seg = decode(seg_id, record)
            except CorruptRecordError as exc:
                log.warning("sarp: rebuild skips %s", exc)
                continue
            keys[count] = seg.hashes[0]
            segs[count] = seg_id
            count += 1
            for holder_id in seg.holder_ids.tolist():
                by_holder.setdefault(holder_id, []).append(seg_id)
        self.directory = Directory.from_entries(keys[:count], segs[:count])
        self.holders = HolderSegments()
        for holder_id, seg_ids in by_holder.items():
            self.holders.add_many(holder_id, seg_ids)
        self._counters.changes_since_snapshot = count
        self._watermark = r.counter("next_seq")

    # -- writes ----------------------------------------------------------------------------

    def insert(
        self,
        hashes: HashesLike,
        parent: int | bytes | None = None,
        *,
        holder: str,
        medium: str = DEFAULT_MEDIUM,
        meta: Sequence[int] | np.ndarray | None = None,
    ) -> int:
        """Record that ``holder`` (in ``medium``) now stores the chain ``hashes``.

        ``hashes`` continue the block ``parent`` (``None``: they start a chain at
        position 0).  The parent must be held by some holder.  Blocks already in the
        index just gain this holder; new ones are packed into segments.  ``meta``
        (one int >= 0 per block, e.g. a block address on the holder) is returned by
        ``match(..., with_meta=True)``.  Returns the number of blocks that were new
        to the index.  At the default durability the insert is on disk when this
        returns.

        Cost: one write transaction: one lookup for the parent and a directory probe
        per segment the chain runs through (stored blocks are found by following
        segments, not looked up one by one), one ``blocks`` entry written per new
        block, and one record write per touched segment (about n/S for n new blocks).

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     index.insert([1, 2, 3], holder="w0"), index.insert([4], parent=3, holder="w0")
        (3, 1)
        """
        chain, parent_hash = _chain_after(hashes, parent)
        name = _holder_name(holder, medium)
        values = _as_meta(meta, chain.size)
        with self._lock:
            store = self._writable_store("insert")
            plan = store.write(lambda w: self._packer.insert(w, chain, parent_hash, name, values))
            self._apply(plan)
            self._counters.inserts += 1
            self._counters.inserted_blocks += plan.new_blocks
            self._maybe_snapshot()
            return plan.new_blocks

    def remove(self, hashes: HashesLike, *, holder: str, medium: str = DEFAULT_MEDIUM) -> int:
        """Record that ``holder`` evicted these blocks from ``medium``.

        Blocks the holder does not hold are skipped (counted as ``remove_missing``
        in :meth:`stats`).  A segment none of whose blocks is held any more is
        deleted.  Returns the number of blocks removed.

        Cost: one write transaction: one lookup per run of consecutive blocks (engines
        evict a chain's blocks together, last first), one record write (or delete,
        with its blocks' entries) per touched segment.

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     _ = index.insert([1, 2, 3], holder="w0")
        ...     index.remove([3, 9], holder="w0"), index.match([1, 2, 3]).num_blocks
        (1, 2)
        """
        chain = as_hashes(hashes)
        name = _holder_name(holder, medium)
        with self._lock:
            store = self._writable_store("remove")
            plan = store.write(lambda w: self._packer.remove(w, chain, name))
            self._apply(plan)
            self._counters.removes += 1
            self._counters.removed_blocks += plan.removed_blocks
            self._counters.remove_missing += chain.size - plan.removed_blocks
            self._maybe_snapshot()
            return plan.removed_blocks

    def clear(self, holder: str, medium: str | None = None) -> int:
        """Forget everything ``holder`` holds (in ``medium``, or in every medium).

        For an engine that reset its cache.  Returns the number of blocks cleared.

        Cost: one write transaction touching only the holder's segments (found
        through its roaring filter, not a scan).

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     _ = index.insert([1, 2], holder="w0"); _ = index.insert([1, 2], holder="w1")
        ...     index.clear("w0"), index.match([1, 2]).by_holder
        (2, {'w1': 2})
        """
        if medium is not None:
            _holder_name(holder, medium)
        elif not isinstance(holder, str) or not holder:
            raise ValueError(f"holder={holder!r}; pass the instance name as a non-empty str")
        with self._lock:
            store = self._writable_store("clear")
            holder_ids = [
                h for h, (inst, med) in self._holder_names.items()
                if inst == holder and (medium is None or med == medium)
            ]
            plan = store.write(lambda w: self._packer.clear(w, holder_ids, self.holders))
            self._apply(plan)
            self._counters.clears += 1
            self._maybe_snapshot()
            return plan.removed_blocks

    def batch(self) -> Batch:
        """Collect inserts, removes and clears; apply them in one transaction on exit.

        One commit (one fsync at ``durability="sync"``), each touched segment
        encoded and written once however many operations touched it, memory updated
        after the commit.  An operation that refuses inside the batch (a parent no
        longer held, a chain conflict) is skipped and reported in ``result.failed``;
        nothing of it is written, and the others are applied in order.  Bad
        arguments raise at the call that adds them, which adds nothing.  On an
        exception inside the ``with`` block nothing is applied.

        Cost: the operations' lookups, one record write per touched segment, one
        commit.

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     with index.batch() as b:
        ...         b.insert([1, 2, 3], holder="w0")
        ...         b.insert([4], parent=3, holder="w0")
        ...         b.insert([9], parent=777, holder="w0")   # its parent is not stored
        ...         b.remove([3, 4], holder="w0")
        ...     [type(e).__name__ for _, e in b.result.failed], index.match([1, 2, 3]).num_blocks
        (['ParentNotFoundError'], 2)
        """
        return Batch(self)

    def apply_batch(self, ops: Sequence[tuple]) -> BatchResult:
        """Apply ``ops`` in one write transaction (see :meth:`batch`).

        ``ops`` are ``("insert", hashes, parent, holder, medium)``, ``("remove",
        hashes, holder, medium)`` and ``("clear", holder, medium_or_None)``.  An
        operation with bad arguments is reported in ``failed`` like one that
        refuses, and the rest are applied.

        Cost: as :meth:`batch`.
        """
        prepared, failed, positions = [], [], []
        for i, op in enumerate(ops):
            try:
                prepared.append(_prepare(op))
                positions.append(i)
            except (ValueError, TypeError) as exc:
                failed.append((i, exc))
        return self._apply_prepared(prepared, positions, failed, len(ops))

    def _apply_decoded(self, ops: Sequence[tuple]) -> BatchResult:
        """:meth:`apply_batch` of operations whose hashes the event decoder has already
        checked (``sarp.serving.events``: uint64 arrays, no hash twice, a parent not
        among them), so they are not checked again; holder names are, once per name.

        Cost: as :meth:`apply_batch`, less a few µs per operation.
        """
        prepared, failed, positions, names = [], [], [], {}
        for i, op in enumerate(ops):
            try:
                kind = op[0]
                if kind == "clear":
                    prepared.append(_prepare(op))
                else:
                    key = (op[3], op[4]) if kind == "insert" else (op[2], op[3])
                    name = names.get(key)
                    if name is None:
                        name = names[key] = _holder_name(*key)
                    prepared.append(("insert", op[1], op[2], name, None) if kind == "insert"
                                    else ("remove", op[1], name))
                positions.append(i)
            except (ValueError, TypeError) as exc:
                failed.append((i, exc))
        return self._apply_prepared(prepared, positions, failed, len(ops))

    def _apply_prepared(self, prepared: list[tuple], positions: list[int],
                        failed: list[tuple[int, Exception]], num_ops: int) -> BatchResult:
        with self._lock:
            store = self._writable_store("batch")
            if not prepared:
                return BatchResult(num_ops, failed, 0, [0] * num_ops)
            plan, refused = store.write(
                lambda w: self._packer.batch(w, prepared, self.holders, self._holder_ids_of))
            self._apply(plan)
            failed += [(positions[j], exc) for j, exc in refused]
            failed.sort(key=lambda f: f[0])
            removed = [0] * num_ops
            for j, count in enumerate(plan.removed_per_op):
                removed[positions[j]] = count
            self._counters.batches += 1
            self._counters.batched_ops += len(prepared)
            self._counters.inserted_blocks += plan.new_blocks
            self._counters.removed_blocks += plan.removed_blocks
            self._maybe_snapshot()
            return BatchResult(num_ops, failed, plan.new_blocks, removed)

    def _reclaim_holder_id(self, avoid: set[int]) -> int | None:
        """A holder id whose holder holds nothing (committed), for reuse; or None."""
        for holder_id in sorted(self._holder_names):
            if holder_id not in avoid and not self.holders.segments(holder_id):
                log.info("sarp: holder ids are all taken; reusing %d (%s, which holds "
                         "nothing)", holder_id, "/".join(self._holder_names[holder_id]))
                return holder_id
        return None

    def _holder_ids_of(self, instance: str, medium: str | None) -> list[int]:
        return [h for h, (inst, med) in self._holder_names.items()
                if inst == instance and (medium is None or med == medium)]

    def _apply(self, plan: Plan) -> None:
        """Bring memory up to date with a committed write."""
        for holder_id, name in plan.holder_names:
            if self._holder_names.get(holder_id) != tuple(name.split(_SEP, 1)):
                self._register_holder(holder_id, name)  # new, or an id reused
        for seg_id, first_hash, holder_ids, is_new in plan.segments:
            if holder_ids is None:
                self.holders.discard_everywhere(seg_id)
                self.directory.remove(first_hash, seg_id)
                continue
            if is_new:
                self.directory.add(first_hash, seg_id)
            for holder_id in plan.dropped.get(seg_id, ()):
                self.holders.discard(holder_id, seg_id)
            for holder_id in holder_ids:
                self.holders.add(holder_id, seg_id)
        self._counters.changes_since_snapshot += len(plan.segments)

    def _maybe_snapshot(self) -> None:
        if self._counters.changes_since_snapshot >= self.snapshot_every_changes:
            self.snapshot()

    # -- reads -----------------------------------------------------------------------------

    def match(
        self, hashes: HashesLike, *, with_meta: bool = False, with_presence: bool = False
    ) -> Match:
        """Longest verified prefix of ``hashes``, overall and per holder.

        Every block counted was compared hash-for-hash with a stored record and is
        held by the holder named: no false positives.

        Cost: one directory probe and one LMDB read per segment step, about
        matched/S + 1 reads; numpy work per segment, none per block in Python.

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     _ = index.insert([1, 2, 3], holder="w0", medium="GPU")
        ...     _ = index.insert([1, 2], holder="w1", medium="CPU")
        ...     m = index.match([1, 2, 3, 4])
        ...     m.num_blocks, m.by_holder, m.by_medium["w1"]
        (3, {'w0': 3, 'w1': 2}, {'CPU': 2})
        """
        query = as_hashes(hashes)
        query_bytes = query.astype("<u8", copy=False).tobytes()
        with self._lock, self._read(query) as r:
            walk = PrefixWalk(self._instance_of if self._multi_medium else None, with_meta,
                              with_presence)
            # a reader's read fetched the predicted records with its counters already
            self._walk(r, walk, query, query_bytes, prefetched=self.readonly)
            for observe in self._match_observers:
                observe(query)
            self._counters.matches += 1
            self._counters.matched_blocks += walk.total
            self._counters.storage_reads += r.reads
            return walk.result(self._holder_names, self._instance_names, r.reads)

    def match_many(
        self, chains: Sequence[HashesLike], *, with_meta: bool = False,
        with_presence: bool = False,
    ) -> list[Match]:
        """:meth:`match` for many chains at once (a scheduler step): one answer per chain.

        Each answer is exactly what ``match`` gives for that chain (the same verified
        prefix, per holder and per medium), and all of them come from one consistent
        state: one read transaction, one catch-up for a reader, and directory probes
        vectorised across the chains, one ``searchsorted`` per segment step of all
        chains still going.

        Cost: about matched/S + 1 LMDB reads per chain, like ``match``, but the fixed
        costs of a call are paid once.

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     _ = index.insert([1, 2, 3], holder="w0")
        ...     [m.num_blocks for m in index.match_many([[1, 2, 9], [7], [1, 2, 3, 4]])]
        [2, 0, 3]
        """
        queries = [as_hashes(c) for c in chains]
        n = len(queries)
        if not n:
            return []
        sizes = [q.size for q in queries]
        # Long chains take match's walk one at a time: their steps are long compares,
        # and the bytes of many of them at once only crowd the cache.
        active = [i for i in range(n) if 0 < sizes[i] <= _LONG_CHAIN]
        unpack = _U64_LE.unpack_from
        everything = np.concatenate(queries)
        with self._lock, self._read(everything) as r:
            instance_of = self._instance_of if self._multi_medium else None  # as caught up
            walks = [PrefixWalk(instance_of, with_meta, with_presence) for _ in range(n)]
            reads = [0] * n
            pos = [0] * n
            if r.capabilities.prefetch and not self.readonly and everything.size:
                # a remote store's writer: one round trip for every chain's records
                ids = self.directory.lookup_many(everything)
                r.prefetch(ids[ids >= 0])
            # each chain's whole walk in one C call: no steps left to share
            one_call = _walks_in_c(r, walks[0])
            for i in range(n):
                if sizes[i] > _LONG_CHAIN or (one_call and sizes[i]):
                    before = r.reads
                    query_bytes_i = queries[i].astype("<u8", copy=False).tobytes()
                    if not (one_call and self._walk_in_c(r, walks[i], query_bytes_i)):
                        self._walk(r, walks[i], queries[i], query_bytes_i, prefetched=True,
                                   in_c=False)
                    reads[i] = r.reads - before
            if one_call:
                active = []
            query_bytes = {i: queries[i].astype("<u8", copy=False).tobytes() for i in active}
            while active:
                firsts = np.fromiter((unpack(query_bytes[i], 8 * pos[i])[0] for i in active),
                                     np.uint64, len(active))
                going = []
                for i, seg_id in zip(active, self.directory.lookup_many(firsts).tolist(),
                                     strict=True):
                    if seg_id < 0:
                        continue
                    p = pos[i]
                    parent = None if p == 0 else unpack(query_bytes[i], 8 * p - 8)[0]
                    before = r.reads
                    step = self._advance(r, walks[i], seg_id, query_bytes[i], p, parent)
                    reads[i] += r.reads - before
                    pos[i] = p + step
                    if step and walks[i].going and p + step < sizes[i]:
                        going.append(i)
                active = going
            for query in queries:
                for observe in self._match_observers:
                    observe(query)
            self._counters.matches += n
            self._counters.storage_reads += sum(reads)
            out = [walk.result(self._holder_names, self._instance_names, reads[i])
                   for i, walk in enumerate(walks)]
            self._counters.matched_blocks += sum(m.num_blocks for m in out)
            return out

    def _walk(self, r: ReadTxn, walk: PrefixWalk, query: np.ndarray, query_bytes: bytes,
              prefetched: bool = False, in_c: bool = True) -> None:
        """One directory probe and one record read per segment step, verified.

        ``prefetched``: the caller fetched this query's predicted records already.
        ``in_c``: try the walk in C first (False: the caller did)."""
        if in_c and _walks_in_c(r, walk) and self._walk_in_c(r, walk, query_bytes):
            return
        native.ran_python("walk")
        if r.capabilities.prefetch and not prefetched:  # remote: one round trip for them all
            ids = self.directory.lookup_many(query)
            r.prefetch(ids[ids >= 0])
        lookup, advance, unpack = self.directory.lookup, self._advance, _U64_LE.unpack_from
        pos, parent, size = 0, None, query.size
        while pos < size:
            seg_id = lookup(unpack(query_bytes, 8 * pos)[0])
            if seg_id is None:
                break
            step = advance(r, walk, seg_id, query_bytes, pos, parent)
            pos += step
            if not step or not walk.going:
                break
            parent = unpack(query_bytes, 8 * (pos - 1))[0]

    def _walk_in_c(self, r: ReadTxn, walk: PrefixWalk, query_bytes: bytes) -> bool:
        """The whole walk in one C call (``sarp._native``), on this transaction's reads;
        False when a segment has more holders than it takes (walk it in Python).
        The caller checked :func:`_walks_in_c`."""
        total, reads, runs, stopped_at = native.C.walk(
            r.native_get, self.directory.lookup, *self.directory.probe_dicts(), query_bytes)
        if stopped_at == -2:
            return False
        r.reads += reads
        walk.take(total, runs)
        if stopped_at >= 0:
            try:
                examine_py(stopped_at, r.raw_records([stopped_at])[0], b"", 0, None)
            except CorruptRecordError as exc:
                self._stop_at_damage(exc)
        return True

    def _advance(
        self, r: ReadTxn, walk: PrefixWalk, seg_id: int, query_bytes: bytes, pos: int,
        parent: int | None,
    ) -> int:
        """Read and verify segment ``seg_id`` at query position ``pos``; return the
        blocks it adds to the walk (0: the match ends here)."""
        record = r.record(seg_id)
        if record is None:
            return 0
        try:
            found = examine(seg_id, record, query_bytes, pos, parent)
        except CorruptRecordError as exc:
            self._stop_at_damage(exc)
            return 0
        if found is None:
            return 0
        return walk.step(seg_id, record, *found)

    def _stop_at_damage(self, exc: CorruptRecordError) -> None:
        # The prefix verified so far is still exact; stop there rather than fail the
        # caller's request. `sarp verify` names the damage.
        self._counters.corrupt_records += 1
        log.error("sarp: match stops at %s", exc)

    # -- snapshots, stats, checks ------------------------------------------------------------

    def snapshot(self) -> int:
        """Write the directory snapshot now; return its size in bytes.

        Then drop the log entries it covers.  Cost: O(directory entries).
        """
        with self._lock:
            store = self._writable_store("snapshot")
            watermark = store.counter("next_seq")
            size = store.save_snapshot(watermark, self.directory, self.holders)
            store.trim_log(watermark)
            self._snapshot_present = True
            self._counters.snapshots += 1
            self._counters.changes_since_snapshot = 0
            return size

    def read_state(self, name: str) -> bytes | None:
        """A small named value kept with the index, or None: the file ``name`` in the
        index folder, or a key of the namespace on Valkey.  ``sarp serve`` keeps its
        resume point (``subscriber.json``) here, so a writer that takes over an index on
        Valkey from another machine resumes from it.  Cost: one file read or GET."""
        with self._lock:
            return self._live_store().load_state(name)

    def write_state(self, name: str, data: bytes, *, durable: bool = False) -> None:
        """Replace the named value atomically (fsync'ed when ``durable``); a writer's call.

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     index.write_state("resume.json", b"{}")
        ...     index.read_state("resume.json")
        b'{}'
        """
        with self._lock:
            self._writable_store("write_state").save_state(name, data, durable)

    def stats(self) -> dict[str, object]:
        """Sizes and counters, for dashboards and the benchmark.

        ``memory_bytes`` counts the directory arrays and the holder bitmaps exactly.
        """
        with self._lock, self._read() as r:
            store = self._live_store()
            blocks = r.stat("blocks")["entries"]
            segments = r.stat("segments")["entries"]
            out: dict[str, object] = {
                "readonly": self.readonly,
                "log_watermark": self._watermark,
                "segments": segments,
                "blocks": blocks,
                "directory_entries": len(self.directory),
                "holders": len(self._holder_names),
                "segment_blocks": self.segment_blocks,
                "durability": store.durability,
                "memory_bytes": self.directory.nbytes() + self.holders.nbytes(),
                "disk_bytes": store.disk_bytes(),
                "recovered_from": self.recovered_from,
                "recovery_reason": self.recovery_reason,
                "replayed_changes": self.replayed_changes,
                "recovery_s": self.recovery_s,
            }
            for name in _Counters.__slots__:
                out[name] = getattr(self._counters, name)
            return out

    def check(self) -> list[str]:
        """Check every invariant against the segments; return the problems found.

        An empty list means the store, directory and holder filters agree.

        Cost: one scan of the segments and the blocks table.

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     _ = index.insert([1, 2], holder="w0")
        ...     index.check()
        []
        """
        with self._lock, self._read() as r:
            damaged = [f"holder {h}: its stored name fails its checksum; its blocks are not "
                       "reported per holder" for h in self._damaged_holders]
            return damaged + check(r, self.directory, self.holders)

    def blocks_of(self, holder: str, medium: str | None = None) -> np.ndarray:
        """Every block ``holder`` holds (in ``medium``, or in any), as sorted uint64.

        Cost: reads the holder's segments only (found through its roaring filter).

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     _ = index.insert([5, 6, 7], holder="w0"); _ = index.remove([6], holder="w0")
        ...     index.blocks_of("w0").tolist()
        [5, 7]
        """
        with self._lock, self._read() as r:
            wanted = {
                h for h, (inst, med) in self._holder_names.items()
                if inst == holder and (medium is None or med == medium)
            }
            parts = [np.empty(0, np.uint64)]
            seg_ids = sorted({s for h in wanted for s in self.holders.segments(h)})
            for seg_id in seg_ids:
                seg = r.segment(seg_id)
                rows = np.isin(seg.holder_ids, list(wanted))
                parts.append(seg.hashes[seg.presence[rows].any(axis=0)])
            return np.unique(np.concatenate(parts))

    def observe_matches(self, callback: Callable[[np.ndarray], None]) -> None:
        """Call ``callback(hashes)`` with every matched query (as a uint64 array).

        For online analysis, e.g. :meth:`sarp.workingset.WorkingSet.observe`.
        Cost: the callback's, inside ``match``.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        with self._lock:
            self._match_observers.append(callback)

    def holders_list(self) -> list[tuple[str, str]]:
        """Every (instance, medium) the index has seen."""
        with self._lock, self._read():
            return sorted(self._holder_names.values())


@dataclass(slots=True)
class BatchResult:
    """What a batch did: operations refused (position, error), blocks new and removed."""

    operations: int
    failed: list[tuple[int, Exception]]
    new_blocks: int
    removed_per_op: list[int]


class Batch:
    """Operations collected for one transaction: ``with index.batch() as b: b.insert(...)``."""

    def __init__(self, index: Index) -> None:
        self._index = index
        self._ops: list[tuple] = []
        self.result: BatchResult | None = None

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            n = len(self._ops)
            self.result = self._index._apply_prepared(self._ops, list(range(n)), [], n)

    def insert(self, hashes: HashesLike, parent: int | bytes | None = None, *, holder: str,
               medium: str = DEFAULT_MEDIUM) -> None:
        """Add an insert (as :meth:`Index.insert`, without ``meta``)."""
        self._ops.append(_prepare(("insert", hashes, parent, holder, medium)))

    def remove(self, hashes: HashesLike, *, holder: str, medium: str = DEFAULT_MEDIUM) -> None:
        """Add a remove (as :meth:`Index.remove`)."""
        self._ops.append(_prepare(("remove", hashes, holder, medium)))

    def clear(self, holder: str, medium: str | None = None) -> None:
        """Add a clear (as :meth:`Index.clear`)."""
        self._ops.append(_prepare(("clear", holder, medium)))


def _prepare(op: tuple) -> tuple:
    """Check one batch operation's arguments; return the packer's form of it."""
    kind = op[0] if isinstance(op, tuple | list) and op else None
    if kind == "insert":
        _, hashes, parent, holder, medium = op
        chain, parent_hash = _chain_after(hashes, parent)
        return ("insert", chain, parent_hash, _holder_name(holder, medium), None)
    if kind == "remove":
        _, hashes, holder, medium = op
        return ("remove", as_hashes(hashes), _holder_name(holder, medium))
    if kind == "clear":
        _, holder, medium = op
        if medium is not None:
            _holder_name(holder, medium)
        elif not isinstance(holder, str) or not holder:
            raise ValueError(f"holder={holder!r}; pass the instance name as a non-empty str")
        return ("clear", holder, medium)
    raise ValueError(f"batch operation {kind!r}; use 'insert', 'remove' or 'clear'")


def _chain_after(hashes: HashesLike, parent: object) -> tuple[np.ndarray, int | None]:
    """An insert's hashes and parent, checked: no hash twice, the parent not among them."""
    chain = as_hashes(hashes)
    parent_hash = None if parent is None else as_hash(parent)
    fault = repeats(chain, parent_hash)
    if fault == "repeat":
        raise ValueError("hashes repeat a value; a chain of block hashes names each block "
                         "once (hash blocks with their parent, e.g. sarp.hash_blocks)")
    if fault == "parent":
        raise ValueError(f"parent={parent_hash} also appears in hashes; pass only the "
                         "blocks after it")
    return chain, parent_hash


def _walks_in_c(r: ReadTxn, walk: PrefixWalk) -> bool:
    """Can ``walk`` be done by ``sarp._native.walk`` on ``r``: the extension is built,
    the store's records are local, and only per-holder runs are wanted."""
    return native.C is not None and walk.plain and r.capabilities.local_reads


def _holders_version(r: ReadTxn) -> tuple[int, int]:
    """Changes when a holder is added, renamed (an id reused) or forgotten."""
    return r.counter("next_holder_id"), r.counter("holder_changes")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r}; pass an int from {low} to {high}")


MAX_NAME_BYTES = 200  # holder and medium names: LMDB keys are at most 511 bytes


def _holder_name(holder: object, medium: object) -> str:
    for label, value in (("holder", holder), ("medium", medium)):
        if not isinstance(value, str) or not value or _SEP in value:
            raise ValueError(
                f"{label}={value!r}; pass a non-empty str without NUL, e.g. holder='w3', "
                "medium='GPU'"
            )
        try:
            size = len(value.encode())
        except UnicodeEncodeError:
            raise ValueError(f"{label}={value[:40]!r} is not valid text (a lone surrogate?); "
                             "pass a name that encodes as UTF-8") from None
        if size > MAX_NAME_BYTES:
            raise ValueError(f"{label} is {size} bytes in UTF-8; pass at most "
                             f"{MAX_NAME_BYTES} (e.g. 'engine-7#3')")
    return f"{holder}{_SEP}{medium}"


def _as_meta(meta: Sequence[int] | np.ndarray | None, num_blocks: int) -> np.ndarray | None:
    if meta is None:
        return None
    values = np.asarray(meta)
    if values.shape != (num_blocks,) or (values.size and values.dtype.kind not in "iu"):
        raise ValueError(
            f"meta has shape {values.shape} and dtype {values.dtype}; pass one int per block "
            f"({num_blocks} ints)"
        )
    if values.size and (values.min() < 0 or values.max() > np.iinfo(np.int64).max):
        raise ValueError("meta values must be ints in [0, 2**63); -1 is reserved for 'none'")
    return values.astype(np.int64)


