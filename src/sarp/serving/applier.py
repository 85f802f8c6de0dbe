"""Decoded event batches applied to the index: each engine rank is one holder, a batch
one index transaction, and an event that cannot be applied is skipped, counted and
logged (at a limited rate) without stopping the rest.  The decoder is
:mod:`sarp.serving.events`; the subscriber (:mod:`sarp.serving.subscriber`) hands
batches here.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .. import native
from ..errors import ChainConflictError, IndexClosedError, ParentNotFoundError, StoreError
from ..holders import DEFAULT_MEDIUM, split_name
from .columns import Columns
from .events import Batch, Cleared, Malformed, Removed, Stored

log = logging.getLogger("sarp.events")
_INSERTS = ("insert", "insert_engine")


def holder_name(source: str, dp_rank: int | None) -> str:
    """The holder a source's blocks are stored under: ``NAME``, or ``NAME#r`` per DP rank.

    Real publishers always send a rank (vLLM and SGLang send 0 without data
    parallelism), so engines followed by ``sarp serve`` appear as ``NAME#r``.

    >>> holder_name("w3", None), holder_name("w3", 1)
    ('w3', 'w3#1')
    """
    return source if dp_rank is None else f"{source}#{dp_rank}"


@dataclass(slots=True)
class ApplyStats:
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    skipped_orphans: int = 0  # stores whose parent is not held (an event was lost)
    skipped_groups: int = 0  # events for KV cache groups other than the first
    bad_events: Counter = field(default_factory=Counter)  # skipped, by kind
    seconds: float = 0.0  # time spent applying


class RateLimitedLog:
    """Warnings about faults from outside, one per (who, kind) at first sight and then
    at most one per ``interval_s``, each saying how many were held back since.

    Cost: a dict lookup per warning.

    >>> RateLimitedLog(log).warn("e0", "bad_frame", "sarp: e0 sent a bad frame")
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger, self.interval_s = logger, interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: Counter = Counter()

    def warn(self, who: str, kind: str, message: str) -> None:
        key, now = (who, kind), time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] += 1
            return
        if len(self._last) > 100_000:  # a stream of new names must not grow it for ever
            self._last.clear()
        more = self._suppressed.pop(key, 0)
        self._last[key] = now
        self.logger.warning("%s%s", message,
                            f" ({more} more like it since the last report)" if more else "")


_bad_event_log = RateLimitedLog(log)


def apply(index, source: str, batch: Batch, stats: ApplyStats | None = None, *,
          dp_rank: int | None = None) -> ApplyStats:
    """Apply a decoded batch from engine ``source`` to ``index`` (one index batch).

    ``BlockStored`` -> ``insert`` under holder ``source#rank`` (``dp_rank`` when
    given, else the batch's rank; plain ``source`` when neither) and the event's
    medium; ``BlockRemoved`` -> ``remove``; ``AllBlocksCleared`` -> ``clear`` of that
    holder in every medium.  Only KV cache group 0 (or events without a group) is
    applied; see ``skipped_groups``.

    A bad event never stops the batch.  It is counted in ``bad_events`` by kind,
    logged (rate-limited) and skipped, keeping the index on the side of knowing
    less than the engine: a store that cannot be applied is not stored (a store
    whose parent is not held is ``skipped_orphans``); a removal that cannot be
    applied as sent drops its blocks from every medium of the holder, or, when
    even its hashes cannot be read, clears the holder.  Errors of the store
    itself (``StoreError``) are not bad events and propagate.

    Cost: one index write transaction (see :class:`Applier` for many batches in one).

    >>> import tempfile, sarp
    >>> from sarp.serving.events import decode, encode_batch
    >>> with sarp.open(tempfile.mkdtemp()) as index:
    ...     s = apply(index, "e0", decode(encode_batch([("stored", [5, 6, 5], None, "GPU"),
    ...                                                 ("stored", [1, 2], None, "GPU")])))
    ...     dict(s.bad_events), index.match([1, 2]).by_holder
    ({'repeated_hash': 1}, {'e0': 2})
    """
    stats = stats or ApplyStats()
    applier = Applier(index)
    applier.add(source, batch, stats, dp_rank=dp_rank)
    applier.flush()
    return stats


class Applier:
    """Turns decoded batches into index operations and applies many in one transaction.

    ``add`` queues a batch's events; ``flush`` applies everything queued with one
    :meth:`sarp.Index.apply_batch` (one commit, each touched segment written once)
    and settles the counts: what was stored and removed, and each refused
    operation as a bad event or an orphan.  A removal the index refused is
    followed, in a second batch, by a clear of its holder (never more than the
    engine).

    Batches can also go in as payloads (:meth:`add_payload`): decoded in C straight
    into the commit's columns (:mod:`sarp.serving.columns`), with no Python object per
    event; they are committed before any batch queued the other way after them.

    Cost: one write transaction per flush.
    """

    def __init__(self, index) -> None:
        self.index = index
        self._roots: dict[str, int] = {}  # holder -> its model root, when token-keyed
        self._ops: list[tuple] = []
        self._meta: list[tuple[ApplyStats, str, str]] = []  # per op: stats, holder, kind
        self._batches: list[ApplyStats] = []
        self._state: Mapping[str, bytes] | None = None  # flush's, for its last commit
        self._state_written = False
        self.columns = Columns()
        self._col_batches: list[tuple[ApplyStats, int, int]] = []  # stats, first row, batches
        self._col_added: tuple = (None, None, 0, 0)  # the last payload's: for keep
        self.commits, self.commit_seconds = 0, 0.0  # index transactions, and their time

    @property
    def pending_ops(self) -> int:
        return len(self._ops) + len(self.columns)

    def discard(self) -> None:
        """Drop everything queued (a write failed: the batches are asked for again)."""
        self._ops, self._meta, self._batches = [], [], []
        self.columns.take()
        self._col_batches = []

    def add_payload(self, payload: bytes, holder: str, *, root: int | None = None,
                    tokens: bool = False) -> tuple[tuple, float, int | None] | None:
        """Decode a batch into the commit's columns (keyed by tokens under ``root``,
        when given): ``(mark, ts, dp_rank)``, then :meth:`keep` or :meth:`drop` it; or
        None when the columns do not take it (decode it and :meth:`add` it instead).
        Cost: a C call, about a microsecond per event.
        """
        if not self.takes_columns:
            return None
        mark = self.columns.mark()
        got = self.columns.add(payload, holder, root, tokens=tokens)
        if got is None:
            return None
        self._col_added = holder, root, got[2], got[3]
        return mark, got[0], got[1]

    @property
    def takes_columns(self) -> bool:
        """Can batches go into the columns now (C, and none queued the other way, which
        go first)?"""
        return native.C is not None and not self._batches

    def keep(self, stats: ApplyStats, mark: tuple) -> None:
        """Count the batch :meth:`add_payload` just added under ``stats``."""
        self.taken(stats, mark[0], 1, *self._col_added)

    def taken(self, stats: ApplyStats, first: int, batches: int, holder: str,
              root: int | None, events: int, skipped: int) -> None:
        """Count under ``stats`` the ``batches`` of ``holder`` (keyed by tokens under
        ``root``, when given) added to the columns from row ``first`` on: ``events``,
        of which ``skipped`` of another KV cache group."""
        if root is not None:
            self._roots[holder] = root
        stats.events += events
        stats.skipped_groups += skipped
        self._col_batches.append((stats, first, batches))

    def drop(self, mark: tuple) -> None:
        """Take back the batch :meth:`add_payload` just added."""
        self.columns.rollback(mark)

    def add(self, source: str, batch: Batch, stats: ApplyStats, *,
            dp_rank: int | None = None, root: int | None = None) -> None:
        """Queue a decoded batch's events (nothing is written until :meth:`flush`).

        ``root``: the source's blocks are keyed by their tokens under this model root
        (:mod:`sarp.aliases` resolves its engine hashes in the write); None: by the
        engine's hashes.
        """
        holder = holder_name(source, batch.dp_rank if dp_rank is None else dp_rank)
        if root is not None:
            self._roots[holder] = root
        for event in batch.events:
            stats.events += 1
            if getattr(event, "group_idx", None) not in (None, 0):
                # Hybrid models report each KV cache group separately; a block counts as
                # cached when group 0 (full attention) has it, so other groups' events
                # could only make the index claim blocks group 0 does not hold.
                stats.skipped_groups += 1
            elif isinstance(event, Stored):
                self._queue(stats, holder, "store", (
                    ("insert", event.block_hashes, event.parent, holder, event.medium)
                    if root is None else
                    ("insert_engine", event.block_hashes, event.parent, holder, event.medium,
                     root, event.token_ids, event.block_size, event.lora_name)))
            elif isinstance(event, Removed):
                self._queue(stats, holder, "remove",
                            self._removal(event.block_hashes, holder, event.medium))
            elif isinstance(event, Cleared):
                self._queue(stats, holder, "clear", ("clear", holder, None))
            else:
                self._add_malformed(stats, holder, event)
        self._batches.append(stats)

    def _queue(self, stats: ApplyStats, holder: str, kind: str, op: tuple) -> None:
        self._ops.append(op)
        self._meta.append((stats, holder, kind))

    def _add_malformed(self, stats: ApplyStats, holder: str, event: Malformed) -> None:
        _bad(stats, holder, event.kind, event.reason)
        if event.event_type != "BlockRemoved":
            return  # a store not applied, or an event we do not know: the index knows less
        if event.block_hashes is None:
            # A removal of blocks we cannot name: only forgetting the holder is safe.
            self._queue(stats, holder, "clear", ("clear", holder, None))
            return
        for medium in self._media_of(holder):
            self._queue(stats, holder, "remove", self._removal(event.block_hashes, holder,
                                                               medium))

    def _removal(self, hashes, holder: str, medium: str) -> tuple:
        """A removal of engine hashes, in the form the holder's keys take."""
        root = self._roots.get(holder)
        if root is None:
            return ("remove", hashes, holder, medium)
        return ("remove_engine", hashes, holder, medium, root)

    def _media_of(self, holder: str) -> list[str]:
        known = {m for inst, m in self.index.holders_list() if inst == holder}
        queued = {op[4] for op in self._ops if op[0] in _INSERTS and op[3] == holder}
        return sorted(known | queued | {DEFAULT_MEDIUM})

    def flush(self, state: Mapping[str, bytes] | None = None) -> bool:
        """Apply everything queued in one index batch (the columns' first, when both
        hold some); settle the counts.  ``state`` (:meth:`sarp.Index.read_state`'s named
        values) joins the last commit, the one after which nothing of this flush is
        left to write; True if it did (False: no commit took it, the caller writes it).
        """
        self._state, self._state_written = state, False
        try:
            if self._col_batches:
                self._flush_columns(last=not self._ops and not self._batches)
            if self._ops or self._batches:
                self._flush_ops()
        finally:
            self._state = None
        return self._state_written

    def _commit(self, ops, last: bool):
        """One commit of the flush; ``last``: nothing is queued after it, so the
        flush's state joins it unless an operation is refused (then the refusal's
        follow-up carries it)."""
        state = self._state if last else None
        started = time.perf_counter()
        result = self.index.apply_decoded(ops, state=state)
        self.commits += 1
        self.commit_seconds += time.perf_counter() - started
        self._state_written |= state is not None and not result.failed
        return result

    def _flush_ops(self) -> None:
        started = time.perf_counter()
        ops, meta, batches = self._ops, self._meta, self._batches
        self._ops, self._meta, self._batches = [], [], []
        try:
            result = self._commit(ops, True)  # decode checked the hashes
        except (StoreError, IndexClosedError):
            raise  # the store itself failed: not the events' fault, nothing to skip
        except Exception as exc:  # a bug of ours must not stop the stream either
            log.exception("sarp: applying a batch of %d operations failed", len(ops))
            self._after_internal_error(ops, meta, exc)
        else:
            self._settle(ops, meta, result)
        share = (time.perf_counter() - started) / max(1, len(batches))
        for stats in batches:
            stats.seconds += share  # apply time, split evenly over the batches applied
            stats.batches += 1

    def _settle(self, ops: list[tuple], meta: list, result) -> None:
        failed = dict(result.failed)
        fallback: list[tuple] = []
        media: dict[str, list[str]] = {}  # a holder's media, read once
        for i, (op, (stats, holder, kind)) in enumerate(zip(ops, meta, strict=True)):
            exc = failed.get(i)
            if exc is None:
                if kind == "store":
                    stats.blocks_stored += op[1].size
                elif kind == "remove":
                    stats.blocks_removed += result.removed_per_op[i]
                else:
                    stats.clears += 1
                    stats.blocks_removed += result.removed_per_op[i]
            elif kind == "store":
                if isinstance(exc, ParentNotFoundError):
                    stats.skipped_orphans += 1
                else:
                    _bad(stats, holder, "chain_conflict" if isinstance(exc, ChainConflictError)
                         else "rejected", str(exc))
                # A refused store's hashes may name other blocks than the index's (hashes
                # the engine did not chain), and a later store may hang under them: the
                # holder lets go of them, so nothing can be claimed below them.
                if holder not in media:
                    media[holder] = self._media_of(holder)
                fallback.extend(self._removal(op[1], holder, medium) for medium in media[holder])
            else:
                _bad(stats, holder, "rejected", str(exc))
                fallback.append(("clear", holder, None))
        if fallback:
            self._commit(fallback, True)

    def _flush_columns(self, last: bool) -> None:
        started = time.perf_counter()
        cols, batches = self.columns.take(), self._col_batches
        self._col_batches = []
        try:
            result = self._commit(cols, last)
        except (StoreError, IndexClosedError):
            raise
        except Exception as exc:  # a bug of ours must not stop the stream either
            log.exception("sarp: applying a commit of %d rows failed", cols.kind.size)
            self._columns_failed(cols, batches, exc, last)
        else:
            self._settle_columns(cols, batches, result, last)
        share = (time.perf_counter() - started) / max(1, sum(n for _, _, n in batches))
        for stats, _, n in batches:
            stats.seconds += share * n
            stats.batches += n

    def _settle_columns(self, cols, batches: list[tuple[ApplyStats, int, int]], result,
                        last: bool) -> None:
        """:meth:`_settle` for the columns: the counts per batch from sums over its
        rows; the refused rows one by one, as there."""
        n = cols.kind.size
        ok = np.ones(n, bool)
        failed = dict(result.failed)
        ok[list(failed)] = False
        stored = np.concatenate([[0], np.cumsum(np.where((cols.kind == 0) & ok, cols.size, 0))])
        removed = np.concatenate([[0], np.cumsum(result.removed_per_op)])
        firsts = [first for _, first, _ in batches] + [n]
        for j, (stats, first, _) in enumerate(batches):
            end = firsts[j + 1]
            stats.blocks_stored += int(stored[end] - stored[first])
            stats.blocks_removed += int(removed[end] - removed[first])
        if not failed:
            return
        fallback: list[tuple] = []
        owner = np.searchsorted(np.array(firsts), np.arange(n), side="right") - 1
        for i, exc in sorted(failed.items()):
            stats = batches[int(owner[i])][0]
            holder, medium = split_name(cols.names[int(cols.name[i])])
            if cols.kind[i] != 0:
                _bad(stats, holder, "rejected", str(exc))
                fallback.append(("clear", holder, None))
            elif isinstance(exc, ParentNotFoundError):
                stats.skipped_orphans += 1
                fallback.extend(self._removal(cols.chain(i), holder, m)
                                for m in self._media_of(holder))
            else:
                _bad(stats, holder, "chain_conflict" if isinstance(exc, ChainConflictError)
                     else "rejected", str(exc))
                fallback.extend(self._removal(cols.chain(i), holder, m)
                                for m in self._media_of(holder))
        self._commit(fallback, last)

    def _columns_failed(self, cols, batches: list[tuple[ApplyStats, int, int]],
                        exc: Exception, last: bool) -> None:
        """:meth:`_after_internal_error` for the columns: every holder clears."""
        for stats, _, n in batches:
            for _ in range(n):
                _bad(stats, "batch", "internal_error", repr(exc))
        # a removal may have been among them: only forgetting its holder is safe
        forget = {split_name(cols.names[int(i)])[0] for i in np.unique(cols.name[cols.kind == 1])}
        if forget:
            self._commit([("clear", h, None) for h in sorted(forget)], last)

    def _after_internal_error(self, ops: list[tuple], meta: list, exc: Exception) -> None:
        forget = set()
        for _op, (stats, holder, kind) in zip(ops, meta, strict=True):
            _bad(stats, holder, "internal_error", repr(exc))
            if kind != "store":
                forget.add(holder)  # it may have been a removal: only forgetting is safe
        if forget:
            self._commit([("clear", h, None) for h in sorted(forget)], True)


def _bad(stats: ApplyStats, holder: str, kind: str, reason: str) -> None:
    stats.bad_events[kind] += 1
    _bad_event_log.warn(holder, kind, f"sarp: {holder}: skipped a bad event ({kind}): {reason}")
