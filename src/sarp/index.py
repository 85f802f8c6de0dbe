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
  segments when the snapshot is missing, stale or damaged (:mod:`sarp.recovery`).

The index is the facade: it checks arguments, takes its lock and a transaction, and
delegates: to :mod:`sarp.ops` (operations checked), :mod:`sarp.packing` (writes),
:mod:`sarp.verify` (the walk), :mod:`sarp.recovery` (memory brought to the store) and
:mod:`sarp.holders` (names).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from . import aliases, recovery, valkey_read
from .check import check
from .counters import Counters
from .errors import IndexClosedError, LeaseLostError, ReadOnlyIndexError
from .hashing import HashesLike, as_hashes
from .holders import DEFAULT_MEDIUM, check_instance, held_blocks, holder_name
from .ops import Batch, BatchResult, as_meta, batch_result, chain_after, prepare_all
from .packing import Packer
from .recovery import Memory
from .store import (
    DEFAULT_MAX_READERS,
    ReadTxn,
    Store,
    check_int,
    is_url,
    open_store,
    shard_location,
)
from .verify import Match, match_chains, match_one
from .writeset import Plan, with_state

log = logging.getLogger("sarp")

DEFAULT_SEGMENT_BLOCKS = 1024
MAX_SEGMENT_BLOCKS = 4096


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
    shard: str | None = None,
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

    ``shard`` (Valkey): open that shard of the sharded index at ``path``, a namespace
    of its own registered under ``path``'s (new ones spread over a cluster's nodes):
    an index like any other, written by the writer of that shard's engines and read,
    with every other shard, by :func:`sarp.open_shards`.

    Cost: loads the snapshot memory-mapped and replays the log after it; without a
    usable snapshot, one scan of every segment (a reader does it in memory only).

    >>> import tempfile, sarp
    >>> with sarp.open(tempfile.mkdtemp()) as index:
    ...     _ = index.insert([11, 12, 13], holder="w0")
    ...     index.match([11, 12, 99]).num_blocks
    2
    """
    if shard is not None:
        path = shard_location(path, shard, create=create and not readonly)
    store_options = {"durability": durability, "create": create,
                     "map_size_bytes": map_size_bytes, "max_readers": max_readers,
                     "lease_s": lease_s, "wait_for_lease_s": wait_for_lease_s}
    return Index(path, store_options, segment_blocks=segment_blocks,
                 snapshot_every_changes=snapshot_every_changes, progress=progress,
                 readonly=readonly)


class Index:
    """An on-SSD KV-cache prefix index. Use :func:`sarp.open` to get one."""

    def __init__(self, path: str | os.PathLike, store_options: dict, *, segment_blocks: int,
                 snapshot_every_changes: int, progress: bool | None, readonly: bool) -> None:
        """See :func:`open` (``store_options`` are :func:`sarp.store.open_store`'s)."""
        check_int("segment_blocks", segment_blocks, 1, MAX_SEGMENT_BLOCKS)
        check_int("snapshot_every_changes", snapshot_every_changes, 1, 1 << 62)
        started = time.perf_counter()
        self.path = path if is_url(path) else Path(path)
        self._lock = threading.RLock()
        self._memory = Memory.empty(self._lock if readonly else threading.RLock())
        self._packer = Packer(segment_blocks, self.path, self._memory)
        self.snapshot_every_changes = snapshot_every_changes
        self._progress = progress
        self._counters = Counters()
        self._match_observers: list[Callable[[np.ndarray], None]] = []
        self.readonly = readonly
        self._store = open_store(path, readonly=readonly, **store_options)
        try:
            with self._store.read() as r:
                done = recovery.recover(self._store, r, self._memory, readonly=readonly,
                                        progress=progress)
            self.recovered_from, self.recovery_reason = done.source, done.reason
            self.replayed_changes = done.replayed
            self._snapshot_present = done.snapshot_present
            self._counters.changes_since_snapshot = done.unsnapshotted
            if self._memory.holders.damaged and not readonly:
                recovery.drop_damaged_holders(self._store, self._packer, self._memory)
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
        return self._memory.holders.multi_medium

    @property
    def directory(self):
        """The routing directory in memory: first block hash -> segment id."""
        return self._memory.directory

    @property
    def holders(self):
        """The holder filters in memory: holder id -> its segments (roaring bitmaps)."""
        return self._memory.filters

    def _live_store(self) -> Store:
        if self._store is None:
            raise IndexClosedError(f"{self.path}: the index is closed; open it again")
        return self._store

    def _writable_store(self, operation: str) -> Store:
        store = self._live_store()
        if self.readonly:
            raise ReadOnlyIndexError(
                f"{self.path}: {operation} on an index opened readonly=True; writes go through "
                "the one writer (sarp serve, or sarp.open without readonly)")
        if store.maybe_applied:  # the last write got no answer: plan from what is stored
            recovery.resync(store, self._memory, self._counters)
        return store

    def _read(self, query: np.ndarray | None = None) -> contextlib.AbstractContextManager[ReadTxn]:
        """A read transaction; a reader's memory is brought up to it first
        (:func:`sarp.recovery.current_read`); a writer's is always current."""
        if self.readonly:
            return recovery.current_read(self._live_store(), self._memory, self._counters, query)
        return self._live_store().read()

    # -- writes ----------------------------------------------------------------------------

    def insert(self, hashes: HashesLike, parent: int | bytes | None = None, *, holder: str,
               medium: str = DEFAULT_MEDIUM, meta: Sequence[int] | np.ndarray | None = None
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
        chain, parent_hash = chain_after(hashes, parent)
        name = holder_name(holder, medium)
        values = as_meta(meta, chain.size)
        with self._lock:
            store = self._writable_store("insert")
            plan = store.write(lambda w: self._packer.insert(w, chain, parent_hash, name, values))
            self._apply(plan)
            self._counters.inserts += 1
            self._counters.inserted_blocks += plan.new_blocks
            self._maybe_snapshot()
            return plan.new_blocks

    def remove(self, hashes: HashesLike, *, holder: str, medium: str = DEFAULT_MEDIUM) -> int:
        """Record that ``holder`` evicted these blocks from ``medium``; return how many.

        Blocks the holder does not hold are skipped (counted as ``remove_missing`` in
        :meth:`stats`); a segment none of whose blocks is held any more is deleted.

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
        name = holder_name(holder, medium)
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
        """Forget everything ``holder`` holds (in ``medium``, or in every medium), as for
        an engine that reset its cache; return the number of blocks cleared.

        Cost: one write transaction touching only the holder's segments (found through
        its roaring filter, not a scan).

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     _ = index.insert([1, 2], holder="w0"); _ = index.insert([1, 2], holder="w1")
        ...     index.clear("w0"), index.match([1, 2]).by_holder
        (2, {'w1': 2})
        """
        check_instance(holder, medium)
        with self._lock:
            store = self._writable_store("clear")
            holder_ids = self._memory.holders.ids_of(holder, medium)
            plan = store.write(lambda w: self._packer.clear(w, holder_ids))
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
        exception inside the ``with`` block nothing is applied.  Cost: the operations'
        lookups, one record write per touched segment, one commit.

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
        return Batch(self._apply_prepared)

    def apply_batch(self, ops: Sequence[tuple]) -> BatchResult:
        """Apply ``ops`` in one write transaction (see :meth:`batch`).

        ``ops`` are ``("insert", hashes, parent, holder, medium)``, ``("remove",
        hashes, holder, medium)`` and ``("clear", holder, medium_or_None)``.  An
        operation with bad arguments is reported in ``failed`` like one that
        refuses, and the rest are applied.  Cost: as :meth:`batch`.
        """
        return self._apply_prepared(*prepare_all(ops), len(ops))

    def apply_decoded(self, ops, *, state: Mapping[str, bytes] | None = None) -> BatchResult:
        """:meth:`apply_batch` of operations whose hashes an event decoder has already
        checked (``sarp.serving.events``: uint64 arrays, no hash twice, a parent not
        among them), so they are not checked again; holder names are, once per name.
        ``ops`` may also be columns (:class:`sarp.serving.columns.Taken`, an operation per
        row; ``removed_per_op`` is then an array).  How ``sarp serve`` applies events.
        ``state``: named values (:meth:`read_state`), put in its transaction if none fails.

        Cost: as :meth:`apply_batch`, less a few µs per operation (columns: none per row).

        >>> import tempfile, sarp, numpy as np
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     r = index.apply_decoded([("insert", np.uint64([1, 2]), None, "w0", "GPU")])
        ...     r.new_blocks, index.match([1, 2]).by_holder
        (2, {'w0': 2})
        """
        if isinstance(ops, Sequence):
            return self._apply_prepared(*prepare_all(ops, hashes_checked=True), len(ops), state)
        n = int(ops.kind.size)
        plan, failed = self._commit(lambda w: aliases.pack_columns(w, self._packer, ops), n, state)
        return BatchResult(n, failed, plan.new_blocks, np.asarray(plan.removed_per_op, np.int64))

    def _apply_prepared(self, prepared: list[tuple], positions: list[int], failed: list,
                        num_ops: int, state: Mapping[str, bytes] | None = None) -> BatchResult:
        """The packer's form of a batch (``positions``: places among ``num_ops``)."""
        done = self._commit(lambda w: aliases.pack(w, self._packer, prepared), len(prepared),
                            None if failed else state)  # a failure's follow-up carries it
        return batch_result(*done, positions, failed, num_ops)

    def _commit(self, write, ops: int, state=None) -> tuple[Plan, list]:
        """One batch write of ``ops`` operations and ``state``, memory, counters."""
        with self._lock:
            store = self._writable_store("batch")
            if not ops and not state:
                return Plan(), []
            plan, refused = store.write(with_state(write if ops else None, state))
            self._apply(plan)
            self._counters.batch(plan, ops)
            self._maybe_snapshot()
            return plan, refused

    def _apply(self, plan: Plan) -> None:
        """Bring memory up to date with a committed write (under ``Memory.lock``)."""
        self._memory.apply(plan, self._live_store())
        self._counters.changes_since_snapshot += len(plan.segments)

    def _maybe_snapshot(self) -> None:
        if self._counters.changes_since_snapshot >= self.snapshot_every_changes:
            self.snapshot()

    # -- reads -----------------------------------------------------------------------------

    def match(self, hashes: HashesLike, *, with_meta: bool = False,
              with_presence: bool | str = False) -> Match:
        """Longest verified prefix of ``hashes``, overall and per holder.

        Every block counted was compared hash-for-hash with a stored record and is held
        by the holder named: no false positives.  ``with_presence="rows"``: see Match.

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
        if self.readonly and self._live_store().capabilities.prefetch:  # Valkey's: in C
            return valkey_read.match_each([self.reading()], query, with_meta, with_presence)[0]
        return self._match(query, with_meta, with_presence)

    def _match(self, query: np.ndarray, with_meta: bool, with_presence: bool) -> Match:
        with self._lock, self._read(query) as r:
            # a reader's read fetched the predicted records with its counters already
            m = match_one(r, self._memory.directory, self._memory.holders, query,
                          self._counters.match_stopped, with_meta=with_meta,
                          with_presence=with_presence, prefetched=self.readonly)
            for observe in self._match_observers:
                observe(query)
            self._counters.matched([m])
            return m

    def read_ahead(self, hashes: HashesLike) -> None:
        """A reader of a remote store: send the read ``match(hashes)`` makes and return;
        that match takes the reply and answers as of it.  Else nothing.  Cost: a send."""
        if self.readonly and self._live_store().capabilities.prefetch:
            with self._lock:
                recovery.read_ahead(self._live_store(), self._memory, as_hashes(hashes))

    @staticmethod
    def match_each(indexes: Sequence[Index], hashes: HashesLike, *, with_meta: bool = False,
                   with_presence: bool = False) -> list[Match]:
        """``[index.match(hashes) for index in indexes]``, the readers' reads at once:
        readers of Valkey namespaces send every read before the first reply is read
        (:func:`sarp.valkey_read.match_each`): one wait in all."""
        return valkey_read.match_each([i.reading() for i in indexes], as_hashes(hashes),
                                      with_meta, with_presence)

    def reading(self) -> valkey_read.Reading:
        """What a match reads, for matches in C (Valkey readers', serve's ``/query``)."""
        return valkey_read.Reading(self._lock, self._live_store(), self._memory, self._counters,
                                   self._match_observers, self._match, self.readonly)

    def match_many(self, chains: Sequence[HashesLike], *, with_meta: bool = False,
                   with_presence: bool = False) -> list[Match]:
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
        if not queries:
            return []
        with self._lock, self._read(np.concatenate(queries)) as r:
            out = match_chains(r, self._memory.directory, self._memory.holders, queries,
                               self._counters.match_stopped, with_meta=with_meta,
                               with_presence=with_presence, prefetch=not self.readonly)
            for query in queries:
                for observe in self._match_observers:
                    observe(query)
            self._counters.matched(out)
            return out

    # -- snapshots, stats, checks ------------------------------------------------------------

    def snapshot(self, *, trim: bool = True) -> int:
        """The directory snapshot written, and with ``trim`` the log it covers dropped (kept:
        readers behind replay it rather than load the snapshot); bytes.  Cost: O(entries)."""
        with self._lock:
            store = self._writable_store("snapshot")
            watermark = store.counter("next_seq")
            size = store.save_snapshot(watermark, *self._memory.compacted())
            if trim:
                store.trim_log(watermark)
                store.release_dead_readers()  # so the pages the trim freed can be reused
            self._snapshot_present = True
            self._counters.snapshots += 1
            self._counters.changes_since_snapshot = 0
            return size

    def release_dead_readers(self) -> int:
        """Free the reader slots of processes that died mid-read (their pages are never
        reused); how many (also at open, at trims, for a new worker).  Cost: one per slot."""
        with self._lock:
            return self._live_store().release_dead_readers()

    def read_state(self, name: str) -> bytes | None:
        """A small named value kept with the index, or None (``sarp serve``'s resume
        point, written in each commit by :meth:`apply_decoded`).  Cost: one read."""
        with self._lock:
            return self._live_store().load_state(name)

    def write_state(self, name: str, data: bytes, *, durable: bool = False) -> None:
        """Replace the named value in a write of its own (fsync'ed when ``durable``).

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     index.write_state("resume.json", b"{}")
        ...     index.read_state("resume.json")
        b'{}'
        """
        with self._lock:
            self._writable_store("write_state").save_state(name, data, durable)

    def stats(self) -> dict[str, object]:
        """Sizes and counters (``memory_bytes``: directory, holders, a writer's aliases)."""
        with self._lock, self._read() as r:
            store, memory = self._live_store(), self._memory
            out: dict[str, object] = {
                "readonly": self.readonly, "log_watermark": memory.watermark,
                "segments": r.stat("segments")["entries"], "blocks": r.stat("blocks")["entries"],
                "directory_entries": len(memory.directory), "holders": len(memory.holders.names),
                "segment_blocks": self.segment_blocks, "durability": store.durability,
                "memory_bytes": memory.nbytes() + store.memory_bytes()
                + aliases.sweep_bytes(self._packer),
                "disk_bytes": store.disk_bytes(), "recovered_from": self.recovered_from,
                "recovery_reason": self.recovery_reason,
                "replayed_changes": self.replayed_changes, "recovery_s": self.recovery_s}
            out.update((name, getattr(self._counters, name)) for name in Counters.__slots__)
            return out

    def check(self) -> list[str]:
        """Check every invariant against the segments; return the problems found (none:
        the store, directory and holder filters agree).  Cost: one scan of the segments
        and the blocks table.

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     _ = index.insert([1, 2], holder="w0")
        ...     index.check()
        []
        """
        with self._lock, self._read() as r:
            damaged = [f"holder {h}: its stored name fails its checksum; its blocks are not "
                       "reported per holder" for h in self._memory.holders.damaged]
            return damaged + check(r, self._memory.directory, self._memory.filters)

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
            return held_blocks(r, self._memory.filters, self._memory.holders.ids_of(holder,
                                                                                    medium))

    def observe_matches(self, callback: Callable[[np.ndarray], None]) -> None:
        """Call ``callback(hashes)`` with every matched query (a uint64 array), for online
        analysis (:meth:`sarp.workingset.WorkingSet.observe`).  Cost: the callback's."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        with self._lock:
            self._match_observers.append(callback)

    def holders_list(self) -> list[tuple[str, str]]:
        """Every (instance, medium) the index has seen."""
        with self._lock, self._read():
            return sorted(self._memory.holders.names.values())
