"""Recovery: an index's memory brought to the state of its store.

What an index keeps in memory (:class:`Memory`: the routing directory, the holder
filters, the holder names, and the log sequence they reflect) is a cache of the store,
rebuilt at will.  At open (:func:`recover`) it comes from the snapshot and the log
entries after its watermark, or from one scan of every segment when the snapshot is
missing, stale or damaged, or the log has a hole.  A reader keeps it current before
every read (:func:`current_read`): it replays the log entries the writer committed
since, in the same read transaction as the read, and reloads when the writer trimmed
the log past it, the log has a hole, or the index was created anew.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

import numpy as np

from . import snapshot as snapshots
from .directory import Directory
from .errors import CorruptRecordError, StoreError
from .filters import HolderSegments
from .holders import Holders, names_version
from .segment import head as segment_head
from .segment import heads
from .store import ReadTxn, Store

log = logging.getLogger("sarp")
READ_ATTEMPTS = 8  # a reader retries when the writer replaced its snapshot meanwhile
SCAN_CHUNK = 4096  # records a rebuild checks in one call
ADD_MANY_FROM = 64  # new segments a commit adds to the directory in one call, from this many


class LogHole(Exception):
    """Entries are missing from the log after the watermark: memory cannot be brought
    up to date from it (a reader reloads, a writer's open rebuilds)."""


@dataclass(slots=True)
class Memory:
    """What an index keeps in memory; all of it can be rebuilt from the store."""

    directory: Directory
    filters: HolderSegments  # holder id -> segments, as roaring bitmaps
    holders: Holders
    watermark: int = 0  # the log sequence this memory reflects
    holders_seen: tuple[int, int] = (0, 0)  # names_version as of the names' last load
    ahead: tuple | None = None  # (query, segment ids) of the last read_ahead, not yet read
    # held while memory changes, and by matches in C (rfc.reading_of): a reader's index
    # lock (its catch-up changes memory under it); a writer's own, taken only in apply,
    # compacted and resync, so that serve's /query on a thread beside the writer waits
    # for no write
    lock: threading.RLock | None = None

    @classmethod
    def empty(cls, lock: threading.RLock | None = None) -> Memory:
        return cls(Directory.from_entries(np.empty(0, np.uint64), np.empty(0, np.uint32)),
                   HolderSegments(), Holders(), lock=lock or threading.RLock())

    def compacted(self) -> tuple[Directory, HolderSegments]:
        """The directory, its changes merged into its arrays under :attr:`lock` (a change
        of memory, which a match in C must not see half done), and the filters: what a
        snapshot writes.  Cost: ``Directory.compact``."""
        with self.lock:
            self.directory.compact()
        return self.directory, self.filters

    def nbytes(self) -> int:
        """The directory's arrays and the holders' bitmaps, exactly."""
        return self.directory.nbytes() + self.filters.nbytes()

    def apply(self, plan, store=None) -> None:
        """Bring memory up to date with a committed write's :class:`sarp.writeset.Plan`,
        under :attr:`lock`; given the writer's ``store`` read in place, the watermark
        too, to the log's counter (matches in C check it against their read's).

        A plan names each segment once, so its changes go in kinds, whatever their
        order: the segments deleted, the new ones, then the filters' rows.

        Cost: a few list passes over the segments, a directory call per segment deleted
        and per new one (one call for them all past ``ADD_MANY_FROM``), one bitmap
        difference per holder for the deleted, and a bitmap operation per holder row.
        """
        with self.lock:
            self._apply(plan)
            if store is not None and store.capabilities.local_reads:
                self.watermark = store.counter("next_seq")

    def _apply(self, plan) -> None:
        self.holders.learn(plan.holder_names)  # new, or ids reused
        directory, filters, segments = self.directory, self.filters, plan.segments
        gone = [(seg_id, first) for seg_id, first, held, _ in segments if held is None]
        if gone:
            filters.discard_many_everywhere([seg_id for seg_id, _ in gone])
            for seg_id, first_hash in gone:
                directory.remove(first_hash, seg_id)
        new = [(first, seg_id) for seg_id, first, _, is_new in segments if is_new]
        if len(new) >= ADD_MANY_FROM:
            directory.add_many(np.array([first for first, _ in new], np.uint64),
                               np.array([seg_id for _, seg_id in new], np.uint32))
        else:
            for first_hash, seg_id in new:
                directory.add(first_hash, seg_id)
        if plan.dropped:
            filters.discard_rows(plan.dropped.items())
        filters.add_rows((seg_id, held) for seg_id, _, held, _ in segments if held)

    def load_holders(self, r: ReadTxn) -> None:
        """The holder names as of ``r`` (a damaged name is logged and left out)."""
        self.holders = Holders(r.holder_names())
        self.holders_seen = names_version(r)
        if self.holders.damaged:
            log.error("sarp: holder names %s fail their checksums; their blocks are not "
                      "reported per holder (sarp verify names them)", self.holders.damaged)


@dataclass(slots=True)
class Recovered:
    """How :func:`recover` brought memory up: ``"new"``, ``"snapshot"`` or ``"rebuild"``
    (and why), log entries replayed, whether a usable snapshot was there, and the
    segment changes memory holds that no snapshot covers."""

    source: str
    reason: str
    replayed: int
    snapshot_present: bool
    unsnapshotted: int


def recover(store: Store, r: ReadTxn, memory: Memory, *, readonly: bool,
            progress: bool | None) -> Recovered:
    """Load the snapshot and replay the log after it, or rebuild; all as of ``r``.

    Cost: the snapshot is mapped, then one record read per segment the log names;
    a rebuild reads every segment once.
    """
    memory.load_holders(r)
    source = "new" if r.stat("segments")["entries"] == 0 else "rebuild"
    say = log.info if readonly else log.warning  # a reader writes nothing: routine
    try:
        snap = store.load_snapshot()
        problem = stale_reason(snap, r, store.index_id)
        if problem:
            raise snapshots.SnapshotUnusable(problem)
    except snapshots.SnapshotUnusable as exc:
        if source == "rebuild":  # a new, empty index needs no reason
            say("sarp: %s; rebuilding the directory from the segments", exc)
        count = rebuild(r, memory, progress)
        return Recovered(source, str(exc) if source == "rebuild" else "", 0, False, count)
    memory.directory, memory.filters, memory.watermark = (snap.directory, snap.holders,
                                                          snap.watermark)
    try:
        replayed = replay_log(r, memory)
    except LogHole as exc:
        say("sarp: %s: %s; rebuilding the directory from the segments", store.path, exc)
        count = rebuild(r, memory, progress)
        return Recovered("rebuild", str(exc), 0, True, count)
    return Recovered("snapshot", "", replayed, True, replayed)


def drop_damaged_holders(store: Store, packer, memory: Memory) -> None:
    """Clear the blocks of holders whose names fail their checksums (the writer, at
    open): nobody could clear them by name, and they must not count as held."""
    ids = list(memory.holders.damaged)

    def repair(w):
        plan = packer.clear(w, ids)
        w.forget_holders(ids)  # the engine's next store under its name gets a new id
        return plan

    plan = store.write(repair)
    memory.apply(plan, store)
    memory.holders.damaged = []
    log.error("sarp: cleared %d blocks of holders %s, whose names are damaged, and forgot "
              "the names", plan.removed_blocks, ids)


def stale_reason(snap: snapshots.Snapshot, r: ReadTxn, index_id: bytes) -> str:
    """Why ``snap`` cannot be used with the store as of ``r``, or ""."""
    if snap.index_id != index_id:
        return "snapshot belongs to another index"
    if snap.watermark < r.counter("log_trimmed_upto"):
        return f"snapshot watermark {snap.watermark} is older than the trimmed log"
    if snap.watermark > r.counter("next_seq"):
        return f"snapshot watermark {snap.watermark} is ahead of the store"
    return ""


def replay_log(r: ReadTxn, memory: Memory) -> int:
    """Apply the log entries after the watermark, as of ``r``; return how many.

    A segment logged several times is re-read once: replaying reads its state as of
    ``r``, which is the same for every entry of it.  Entries run on from the watermark
    without a hole; one missing (a stream trimmed by another client) raises
    :class:`LogHole` before memory changes, and the caller reloads.

    Cost: the entries read as arrays (``log_arrays``), a dict operation per entry, then
    :func:`replay`.
    """
    seqs, seg_ids, firsts = r.log_arrays(memory.watermark)
    count, last = int(seqs.size), memory.watermark + int(seqs.size)
    if count and (seqs[0] != memory.watermark + 1 or seqs[-1] != last):  # keys ascend
        at = int(np.flatnonzero(seqs != memory.watermark + 1 + np.arange(count))[0])
        raise LogHole(f"log entry {memory.watermark + 1 + at} is missing (the next is "
                      f"{int(seqs[at])})")
    newest = r.counter("next_seq")
    if last < newest:
        raise LogHole(f"log entries {last + 1}..{newest} are missing")
    # segment id -> every first hash logged for it, in the order of its last entry: an
    # id can name another chain once its segment is gone (a tail's id is taken again)
    latest: dict[int, list[int]] = {}
    for seg_id, first_hash in zip(seg_ids.tolist(), firsts.tolist(), strict=True):
        logged = latest.pop(seg_id, None)
        if logged is None:
            logged = [first_hash]
        elif first_hash not in logged:
            logged.append(first_hash)
        latest[seg_id] = logged
    replay(r, memory, latest)
    memory.watermark = max(last, newest)
    return count


def replay(r: ReadTxn, memory: Memory, latest: dict[int, list[int]]) -> None:
    """Bring the directory and the holder filters to the state of ``r`` for the
    segments in ``latest`` (segment id -> the first hashes logged for it): the entry of
    each hash the id no longer starts with goes, if it names this id.

    Cost: one record read per segment (one round trip for them all on a remote store),
    their checks in one call (:func:`sarp.segment.heads`), one dict update for the
    directory and one bitmap operation per holder.
    """
    ids = list(latest)
    memory.filters.discard_many_everywhere(ids)
    firsts, states, counts, holder_ids = _heads(ids, r.raw_records(ids), "replay")
    directory = memory.directory
    found = states > 0
    # The removals first, then the additions: an entry goes only if it names its own
    # id, and no id adds a hash it removes, so their order within a replay is free.
    for seg_id, first, ok in zip(ids, firsts.tolist(), found.tolist(), strict=True):
        logged = latest[seg_id]
        if not ok or len(logged) > 1 or logged[0] != first:
            for first_hash in logged:
                if not ok or first_hash != first:
                    directory.remove(first_hash, seg_id)
    seg_ids = np.array(ids, np.int64)
    directory.add_many(firsts[found], seg_ids[found])
    if holder_ids.size:
        segs = np.repeat(seg_ids, counts).tolist()
        held: dict[int, list[int]] = {}
        for holder_id, seg_id in zip(holder_ids.tolist(), segs, strict=True):
            held.setdefault(holder_id, []).append(seg_id)
        for holder_id, part in held.items():
            memory.filters.add_many(holder_id, part)


def _heads(ids: list[int], records: list, what: str) -> tuple[np.ndarray, ...]:
    """:func:`sarp.segment.heads` of ``records``, each damaged one checked again in
    Python and skipped with a warning that names the damage."""
    out = heads(records)
    for i in np.flatnonzero(out[1] < 0).tolist():
        try:
            segment_head(ids[i], records[i])  # raises, naming the damage
        except CorruptRecordError as exc:
            log.warning("sarp: %s skips %s", what, exc)
    return out


def rebuild(r: ReadTxn, memory: Memory, progress: bool | None = None) -> int:
    """Scan every segment (as of ``r``) to rebuild the directory and the holder
    filters; return how many segments it read.  Cost: one read of every record, their
    checks in one call per ``SCAN_CHUNK`` (:func:`sarp.segment.heads`).

    The watermark is the log's counter from before the scan.  On a store whose reads
    are not one snapshot (Valkey: the scan is ``HSCAN``, which may return a record
    twice, while a writer goes on), a reader's next catch-up then replays what was
    written during the scan (and reads the holder names again if they changed), so it
    ends as current as the writer.  On LMDB nothing is written during ``r``.
    """
    start = r.counter("next_seq")
    count = _scan(r, memory, progress)
    memory.watermark = start
    return count


def _scan(r: ReadTxn, memory: Memory, progress: bool | None) -> int:
    firsts: dict[int, int] = {}  # segment id -> first hash (a record met twice is one)
    by_holder: dict[int, list[int]] = {}
    records = r.raw_segments()
    if progress or (progress is None and sys.stderr.isatty()):  # tqdm's own test for None
        from tqdm import tqdm  # only for a bar someone sees: the import costs 15-45 ms

        records = tqdm(records, total=r.stat("segments")["entries"],
                       desc="sarp: rebuilding directory", unit="seg", leave=False)
    while chunk := list(islice(records, SCAN_CHUNK)):
        ids = [seg_id for seg_id, _ in chunk]
        raw = [record for _, record in chunk]
        found, states, counts, holder_ids = _heads(ids, raw, "rebuild")
        held, at = holder_ids.tolist(), np.concatenate([[0], np.cumsum(counts)]).tolist()
        for i, (seg_id, first, ok) in enumerate(zip(ids, found.tolist(), (states > 0).tolist(),
                                                   strict=True)):
            if ok and seg_id not in firsts:
                firsts[seg_id] = first
                for holder_id in held[at[i] : at[i + 1]]:
                    by_holder.setdefault(holder_id, []).append(seg_id)
    memory.directory = Directory.from_entries(
        np.fromiter(firsts.values(), np.uint64, len(firsts)),
        np.fromiter(firsts.keys(), np.uint32, len(firsts)))
    memory.filters = HolderSegments()
    for holder_id, seg_ids in by_holder.items():
        memory.filters.add_many(holder_id, sorted(seg_ids))
    return len(firsts)


def catch_up(store: Store, r: ReadTxn, memory: Memory, counters) -> bool:
    """A reader: bring memory to the state of ``r``.  False: retry with a newer ``r``.

    Cost: two meta reads (the index id, the log's counter) when nothing changed; else
    one segment read per changed segment, or a snapshot load when the writer trimmed
    the log past us, the log has a hole, or the index was created anew.
    """
    index_id = r.index_id()
    renewed = index_id != store.index_id
    seq = r.counter("next_seq")
    if seq == memory.watermark and not renewed:
        return True
    if renewed or names_version(r) != memory.holders_seen:
        memory.load_holders(r)
    if renewed:
        # Made anew under us (a Valkey that restarted empty and was written again): its
        # counters can land where ours stood, so they prove nothing.
        log.warning("sarp: %s was created anew since this reader caught up; reloading",
                    store.path)
        old_id, store.index_id = store.index_id, index_id
        if not reload(store, r, memory, seq, counters):
            store.index_id = old_id  # the next attempt sees it anew again
            return False
        counters.index_reloads += 1
        return True
    if r.counter("log_trimmed_upto") > memory.watermark:
        return reload(store, r, memory, seq, counters)
    try:
        replay_log(r, memory)
    except LogHole as exc:
        log.warning("sarp: %s: %s; reloading", store.path, exc)
        counters.log_holes += 1
        return reload(store, r, memory, seq, counters)
    return True


def resync(store: Store, memory: Memory, counters) -> None:
    """A writer whose last write may have been applied without its answer reaching it
    (``store.maybe_applied``): memory from the store again (names, then the snapshot and
    the log after it, or a rebuild), so that the next write plans from what is stored,
    not from what memory believes.  Cost: a reader's reload."""
    with memory.lock, store.read() as r:
        memory.load_holders(r)
        if not reload(store, r, memory, r.counter("next_seq"), counters):
            rebuild(r, memory)  # a snapshot newer than this read: not ours to trust
    store.maybe_applied = False
    log.warning("sarp: %s: memory read again from the store after a write that got no "
                "answer", store.path)


def reload(store: Store, r: ReadTxn, memory: Memory, seq: int, counters) -> bool:
    """A reader: memory from the snapshot and the log after it, or a rebuild in memory
    when the snapshot cannot be used.  False: retry with a newer ``r``."""
    try:
        snap = store.load_snapshot()
    except snapshots.SnapshotUnusable:
        snap = None
    if snap is not None and snap.watermark > seq:
        return False  # a snapshot newer than this transaction: take a newer one
    if snap is None or stale_reason(snap, r, store.index_id):
        rebuild(r, memory)  # in memory only
        counters.reader_rebuilds += 1
        return True
    memory.directory, memory.filters, memory.watermark = (snap.directory, snap.holders,
                                                          snap.watermark)
    counters.snapshot_reloads += 1
    try:
        replay_log(r, memory)
    except LogHole:
        rebuild(r, memory)
        counters.reader_rebuilds += 1
    return True


def read_ahead(store: Store, memory: Memory, query: np.ndarray) -> None:
    """Send the read :func:`current_read` makes first for ``query`` (a remote store's
    ``read_ahead``); its reply waits for that read."""
    memory.ahead = (query, memory.directory.predicted_keys(query))
    store.read_ahead(memory.ahead[1])


def current_read(store: Store, memory: Memory, counters,
                 query: np.ndarray | None) -> contextlib.AbstractContextManager[ReadTxn]:
    """A reader's read transaction, with memory brought up to it first.

    ``query``: the hashes about to be matched, so that a reader of a remote store
    fetches the records its directory predicts together with the counters of its
    catch-up, in one round trip.  Cost, when nothing changed: a transaction and its two
    meta reads (a local store's in a plain class: a generator's context manager was
    most of a hot worker's 4 µs here).
    """
    if store.capabilities.prefetch:
        return _remote_read(store, memory, counters, query)
    memory.ahead = None
    return _LocalRead(store, memory, counters)


class _LocalRead:
    """:func:`current_read` of a store read in place (LMDB)."""

    __slots__ = ("_store", "_memory", "_counters", "_r")

    def __init__(self, store: Store, memory: Memory, counters) -> None:
        self._store, self._memory, self._counters = store, memory, counters

    def __enter__(self) -> ReadTxn:
        for _ in range(READ_ATTEMPTS):
            r = self._store.read()
            r.__enter__()
            try:
                current = catch_up(self._store, r, self._memory, self._counters)
            except BaseException as exc:
                r.__exit__(type(exc), exc, exc.__traceback__)
                raise
            if current:
                self._r = r
                return r
            r.__exit__(None, None, None)
        raise StoreError(f"{self._store.path}: the writer kept replacing its snapshot; "
                         "try again")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._r.__exit__(exc_type, exc, tb)


@contextlib.contextmanager
def _remote_read(store: Store, memory: Memory, counters,
                 query: np.ndarray | None) -> Iterator[ReadTxn]:
    """:func:`current_read` of a remote store (Valkey: prefetched with the counters)."""
    prefetch = store.capabilities.prefetch
    ahead, memory.ahead = memory.ahead, None
    for attempt in range(READ_ATTEMPTS):
        with store.read() as r:
            if query is not None and prefetch:
                if ahead is not None and not attempt and (ahead[0] is query or np.array_equal(
                        ahead[0], query)):  # (match_many's chains, joined again)
                    wanted = ahead[1]  # what read_ahead predicted and sent
                else:
                    wanted = memory.directory.predicted_keys(query)
                r.prefetch(wanted, with_counters=True)
            seen = (memory.watermark, memory.holders_seen, counters.index_reloads)
            if catch_up(store, r, memory, counters):
                now = (memory.watermark, memory.holders_seen, counters.index_reloads)
                if prefetch and seen != now:
                    # A remote store's reads are separate commands: read again, so that
                    # the records come from the same atomic read as the counters this
                    # memory is now current with.
                    if attempt < READ_ATTEMPTS - 1:
                        continue
                    r.forget_prefetched()
                yield r
                return
    raise StoreError(f"{store.path}: the writer kept replacing its snapshot; try again")
