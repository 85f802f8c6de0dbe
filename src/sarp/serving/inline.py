"""The in-line half of the subscriber (:mod:`.subscriber`): a source's live messages
next in its sequence, taken in C by the lane (:mod:`.lane`) a few at a time and,
while a commit is written in a backlog, by a :class:`~.lane.Prefetch` on the other
core; anything else goes to the subscriber's ``_on_message``, one by one.
"""

from __future__ import annotations

import time

import zmq

from .applier import holder_name
from .lane import DRY, TAKEN_ALL, Prefetch
from .replay import TS_SLACK_S, fault_log, recv_message

ROUND_MESSAGES = 8  # messages taken from one source before the next one's turn


class InLine:
    """Taking live messages in line, on the subscriber's state (its sources and their
    fingerprints, the applier and its columns, the lane)."""

    prefetching = True  # a prefetch while a backlog's commit is written (False: never)
    prefetched = 0  # batches a prefetch took
    prefetch_failures = 0  # prefetches that could not start, or lost what they took

    def _round(self, sock: zmq.Socket, key: str) -> tuple[int, int, bool]:
        """A source's turn: up to ``ROUND_MESSAGES`` of its live messages, those next in
        line in one C call (:mod:`.lane`); (batches applied, messages taken, whether
        more may be waiting).  A commit's turn comes only once every message received
        is handled: a prefetch in it goes on from there."""
        applied = taken = 0
        while taken < ROUND_MESSAGES:
            status, got, frames = self._in_line(sock, key, ROUND_MESSAGES - taken)
            applied, taken = applied + got, taken + got
            if frames is None and status != DRY and taken < ROUND_MESSAGES:
                try:
                    frames = recv_message(sock.recv)
                except zmq.Again:
                    status = DRY
            if frames is not None:
                taken += 1
                applied += self._on_message(key, frames)
            if got or frames is not None:
                self._maybe_flush()
            if status == DRY or key in self._jobs:
                return applied, taken, False  # (a job: its live stream waits for the replay)
        return applied, taken, True

    def _in_line(self, sock: zmq.Socket, key: str, count: int) -> tuple[int | None, int, list]:
        """The source's live messages next in line, decoded into the commit's columns
        by the lane: (its status, or None when it was not asked; batches queued; the
        frames of the message after them, or None)."""
        line = self._line(sock, key)
        if line is None:
            return None, 0, None
        first = len(self.applier.columns)
        got = self._lane.take(line[0], count, *line[1:], self.applier.columns)
        self._took(key, line[1], line[6], first, got)
        return got[0], len(got[1]), got[5]

    def _line(self, sock: zmq.Socket, key: str) -> tuple | None:
        """The lane's arguments for the source (:meth:`~.lane.Lane.take`'s without the
        count and the columns), or None while its messages go one by one."""
        source, fp = self.sources[key], self.state.get(key)
        expected = 0 if fp is None else fp.seq + 1
        live_last = self._live_last.get(key)
        if self._lane is None or not self.applier.takes_columns or (
                live_last is not None and expected <= live_last) or self._hashes_unchecked(key):
            return None
        rank = self._rank(key)
        return (sock, expected, -float("inf") if fp is None else fp.ts - TS_SLACK_S,
                TS_SLACK_S, source.model is not None, source.root,
                holder_name(source.name, rank), rank, source.dp_rank is not None)

    def _took(self, key: str, expected: int, holder: str, first: int, got: tuple) -> None:
        """Queue what the lane took of the source (``got``: its answer), in the
        columns from row ``first`` on."""
        if got[1]:
            self._count_took(key, holder, first, got)
            self._queue_took(key, expected, got[1], got[2])

    def _count_took(self, key: str, holder: str, first: int, got: tuple) -> None:
        """The applier's count of a take (in row order: its rows begin at ``first``)."""
        self.applier.taken(self.stats[key].applied, first, len(got[1]), holder,
                           self.sources[key].root, got[3], got[4])

    def _queue_took(self, key: str, expected: int, digests: list, stamps: list) -> None:
        """The source's batches ``expected`` on (their digests and stamps) queued."""
        last = expected + len(digests) - 1
        self._heard[key] = time.monotonic()
        self._gone.discard(key)
        self._live_last[key] = last
        self._drop_ahead(key, last)
        self._queued(key, expected, digests, stamps, None)

    def _flush_taking(self, max_events: int) -> bool:
        """:meth:`flush`, while a :class:`~.lane.Prefetch` takes the next commit's
        messages in line (``max_events`` at most) on the other core; then queue them,
        and hand each source's first out of line to ``_on_message``.  Whether it
        stopped with messages still in line (then what it took is best committed at
        once, while it takes the next).  A failed write drops them too: every source
        is proven again from its last committed batch (the subscriber's
        ``_store_failed``)."""
        lines = [line for sock, key in self._subs.items() if key not in self._jobs
                 and (line := self._line(sock, key)) is not None] if self.prefetching else []
        prefetch = None
        try:
            prefetch = Prefetch.start(lines, ROUND_MESSAGES, max_events,
                                      self.applier.columns) if lines else None
        except (OSError, MemoryError) as exc:  # no thread, no memory: the commit alone
            self._prefetch_failed(exc)
        try:
            self.flush()
        except BaseException:
            if prefetch is not None:
                prefetch.drop()
            raise
        if prefetch is None:
            return False
        keys = [self._subs[line[0]] for line in lines]
        try:
            taken = prefetch.end(self.applier.columns)
        except MemoryError as exc:  # what it took is lost: a gap, which a replay proves
            self._prefetch_failed(exc)
            return False
        last, queued = {}, {}  # (a source's takes follow each other in its sequence:
        for j, expected, first, got in taken:  # each one's queued once, for them all)
            if got[1]:
                self._count_took(keys[j], lines[j][6], first, got)
                digests, stamps = queued.setdefault(j, (expected, [], []))[1:]
                digests += got[1]
                stamps += got[2]
            self.prefetched += len(got[1])
            last[j] = got[0]
        for j, (expected, digests, stamps) in queued.items():
            self._queue_took(keys[j], expected, digests, stamps)
        for j, _, _, got in taken:
            if got[5] is not None:
                self._on_message(keys[j], got[5])
        return TAKEN_ALL in last.values()

    def _prefetch_failed(self, exc: Exception) -> None:
        self.prefetch_failures += 1
        fault_log.warn("prefetch", "failed", f"sarp: a prefetch failed ({exc!r}); its "
                       "messages are taken again after the commit, or replayed")
