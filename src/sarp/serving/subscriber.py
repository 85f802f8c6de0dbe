"""Following engines' KV event streams over ZeroMQ, and keeping the index true to them.

A source is one engine publisher: vLLM and SGLang run one per DP rank, each on its
own port (base + rank) with its own sequence from 0, so an engine with ranks is
several sources (:meth:`Source.expand`).  Each has a SUB socket on its PUB
endpoint (frames ``(topic, 8-byte big-endian sequence, msgpack payload)``) and
optionally a replay endpoint (a ROUTER: send the first wanted sequence as 8 bytes
from a DEALER; it answers ``(seq, payload)`` frames, with or without a topic
frame, and ends with sequence -1).

The rule: **the index may know less than an engine, never more.**  Per source the
subscriber keeps a fingerprint of the last applied batch: its sequence, a digest
of its payload and its timestamp.  A batch is applied only when it continues what
was applied, and continuity is *proven*, not assumed:

* the next sequence in line is applied (unless its timestamp is earlier than the
  last applied one, or the SUB socket reconnected since: both are checked first);
* anything else (a gap, a restart of ``sarp serve``, a reconnect, a sequence the
  fingerprint cannot place) asks the engine's replay buffer from the last applied
  sequence: if the buffer still holds that batch with the same digest, the
  continuation is applied from the buffer; if not, the engine restarted (or its
  buffer no longer reaches back), so its holders are cleared and rebuilt from
  everything its buffer holds;
* without a replay endpoint nothing can be proven, so those cases clear the
  engine's holders and go on from the next batch;
* the live stream of one engine only goes forward: a sequence at or below the last
  one seen live means a new engine, handled as above.

A replay never blocks the loop: it runs as the source's job (:class:`Job`), fed by
:meth:`Subscriber.poll` as its frames arrive, while the other sources are followed;
frames are applied as they come, with a deadline per useful frame and a budget per
attempt (:class:`ReplayBudget`).  An attempt over budget, or without its end marker,
clears the source and is retried after a backoff.  A frame with a negative sequence,
or one the engine's own buffer does not know, is a bad frame: counted and dropped.
A batch that cannot be decoded is a lost batch (the holders are cleared); a bad event
inside a readable batch is skipped (:func:`sarp.serving.applier.apply`).

An engine that dies stops publishing, but so does one that is idle.  So a source
with a replay endpoint that has sent nothing for ``probe_after_s`` is asked on it
(for sequences beyond any it has: the answer is just the end marker); an engine
that neither answers nor publishes within ``dead_after_s`` is taken as gone and its
holders are cleared.  If it answers later it is back: its buffer is replayed from sequence 0,
as for any engine the subscriber knows nothing about.  A source without a replay
endpoint cannot be asked, and keeps its holders until it publishes again.

The fingerprints (``subscriber.json``, a named value of the index) are written in the
transaction that commits what they describe, so a restarted subscriber resumes exactly
where it stopped.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import zmq

from ..errors import StoreError
from .applier import Applier, holder_name
from .early import close_engines, zmq_context
from .events import BadEvent, Batch, decode
from .hashcheck import HashCheck
from .inline import InLine
from .lane import Lane
from .replay import TS_SLACK_S, Job, ReplayJobs, fault_log, frame_digest, parse_frames
from .sources import (
    Fingerprint,
    FingerprintFile,
    ReplayBudget,
    Source,
    SourceStats,
    load_fingerprints,
    plain,
)

log = logging.getLogger("sarp.subscriber")

MAX_BATCH_OPS = 16384  # events applied in one index transaction, at most
MAX_BATCH_MS = 20.0  # ... and how long the first of them may wait for the commit,
MAX_CATCH_UP_MS = 80.0  # ... doubled up to this while the sockets never run dry,
BEHIND_S = 1.0  # ... and this at once for a batch published longer ago than this;
COMMIT_WAIT_MS = 5.0  # ... and how long it waits for more once the sockets ran dry
MAX_FRAME_BYTES = 64 << 20  # a frame over this is never received (vLLM's are KiB to MiB)
POLL_MESSAGES = 65_536  # live messages one poll takes at most before the jobs' turn
STORE_RETRY_S, MAX_STORE_RETRY_S = 0.25, 5.0  # ... and after a failed write to the index


class Subscriber(InLine, ReplayJobs):
    """Apply the KV events of ``sources`` to ``index``; see the module docstring.

    ``replay_idle_timeout_s`` is how long a replay may go without delivering a
    frame before it is taken as ended without its end marker.  ``on_commit``, if
    given, is called after each commit with the fingerprints of the batches it
    applied (for measuring publish-to-applied lag).  ``probe_after_s`` (None: never)
    and ``dead_after_s``: when a silent engine is asked whether it is still there,
    and how long it has to answer before its holders are cleared.
    ``max_frame_bytes``: a frame larger than this is never received (libzmq drops the
    connection, which reconnects; counted in ``disconnects``).  ``replay_budget``:
    what one replay attempt may take (:class:`ReplayBudget`).  ``commit_wait_ms``: how
    long the first batch queued waits for more before its commit, when it came within
    that of the last commit (a small commit costs LMDB about as many page writes per
    event as one of hundreds shares); 0, or a batch after a quiet spell: at once.
    ``adopt``: SUB sockets connected before (``early.connect_engines``), used for the
    sources of their endpoints; the rest closed.

    A replay never blocks the loop: it runs as the source's job, fed by :meth:`poll`
    as its frames arrive, while every other source is followed.

    Cost: one index write per event; a replay round trip per continuity check.
    """

    def __init__(
        self,
        index,
        sources: list[Source],
        *,
        replay_idle_timeout_s: float = 5.0,
        context: zmq.Context | None = None,
        on_commit=None,
        probe_after_s: float | None = 30.0,
        dead_after_s: float = 10.0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        replay_budget: ReplayBudget | None = None,
        hash_check: HashCheck | None = None,
        max_sources: int | None = None,
        commit_wait_ms: float = COMMIT_WAIT_MS,
        adopt: dict | None = None,
    ) -> None:
        if isinstance(commit_wait_ms, bool) or not isinstance(commit_wait_ms, int | float) \
                or not 0 <= commit_wait_ms <= MAX_BATCH_MS:
            raise ValueError(f"commit_wait_ms={commit_wait_ms!r}; pass a number of "
                             f"milliseconds from 0 to {MAX_BATCH_MS:g}")
        self._commit_wait_s = commit_wait_ms / 1000
        self._dry = True  # did the last read run every socket dry?
        if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int) \
                or max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes={max_frame_bytes!r}; pass an int >= 1024")
        self.max_frame_bytes = max_frame_bytes
        self.replay_budget = replay_budget or ReplayBudget()
        keys = [s.key for s in sources]
        if len(set(keys)) != len(keys):
            raise ValueError(f"sources must be distinct, got {keys}")
        self.max_sources = max_sources
        if max_sources is not None and len(sources) > max_sources:
            raise ValueError(self._full(len(sources)))
        plain = {s.name for s in sources if s.dp_rank is None}
        if any(s.name in plain for s in sources if s.dp_rank is not None):
            raise ValueError(f"engine names must not be given both per rank and whole: {keys}")
        self.index = index
        self.sources = {s.key: s for s in sources}
        self.replay_idle_timeout_s = replay_idle_timeout_s
        self._ctx = zmq_context(context)
        self.state: dict[str, Fingerprint] = load_fingerprints(index)  # applied or queued
        self._committed: dict[str, Fingerprint] = dict(self.state)  # what subscriber.json says
        self._dirty: dict[str, Fingerprint] = {}  # queued, not yet committed
        self._state_file = FingerprintFile(index)
        self.applier = Applier(index)  # (its commits and their seconds: serve's status)
        self._queued_since: float | None = None
        self._committed_at = time.monotonic()  # when the last commit ended
        self._batch_ms = MAX_BATCH_MS  # the wait now allowed (longer while catching up)
        self._behind = False  # the last prefetch stopped with messages still in line
        self._on_commit = on_commit  # called with the fingerprints of each commit's batches
        self._queued_fps: list[Fingerprint] = []
        self._lane = Lane.open()  # live messages in line taken in C (None: one by one)
        self.stats = {key: SourceStats() for key in self.sources}
        # sources whose hashes have not yet been checked against their tokens
        self._hash_check = hash_check
        self._hash_pending = set(self.sources) if hash_check is not None else set()
        self._live_last: dict[str, int] = {}  # last sequence seen on the live stream
        self._ranks: dict[str, int | None] = {}  # the rank the last batch named, per source
        self._ahead: dict[str, dict[int, int]] = {k: {} for k in self.sources}  # seq -> digest
        self._connects: Counter = Counter()
        self._verify: set[str] = set()  # sources whose continuity must be checked first
        self._rejected = False  # the message being handled was a bad frame
        self.last_applied_at: dict[str, float] = {}  # wall-clock time of the last batch
        for name, value in (("probe_after_s", probe_after_s), ("dead_after_s", dead_after_s)):
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"{name}={value!r}; pass a number of seconds > 0")
        self.probe_after_s, self.dead_after_s = probe_after_s, dead_after_s
        now = time.monotonic()
        self._heard = {key: now for key in self.sources}  # last frame or answer from each
        self._probes: dict[zmq.Socket, tuple[str, float]] = {}  # asked, and when
        self._gone: set[str] = set()  # taken as gone: cleared, still asked now and then
        self._unchecked: set[str] = set()  # sources whose start-up check has not ended
        self._clean: set[str] = set()  # cleared, and nothing of theirs applied since
        self.store_errors = 0  # writes to the index that failed (and were retried)
        self._store_retry_at = 0.0
        self._store_backoff = STORE_RETRY_S
        self._jobs: dict[str, Job] = {}  # sources waiting on their replay endpoint
        self._retry_at: dict[str, float] = {}  # sources whose replay failed: when to retry
        self._backoff: dict[str, float] = {}  # the next wait after another failure
        self._subs: dict[zmq.Socket, str] = {}
        self._sub_of: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}
        self._poller = zmq.Poller()
        self._adopt = adopt if adopt is not None else {}  # endpoint -> (socket, monitor)
        try:
            for source in sources:
                self._connect(source)
        finally:  # sockets connected before, for sources no longer followed
            close_engines(self._adopt)

    # -- engines that come and go -----------------------------------------------------------

    def add_source(self, source: Source) -> None:
        """Follow one more engine from now on, while every other goes on: its SUB socket
        connects, and its continuity is checked as at start-up (its replay buffer is
        asked, a job the polls feed).  A ValueError for a key already followed, a name
        followed both per rank and whole, or one past ``max_sources``; an OSError when
        the process is out of descriptors (nothing changed either way).  Cost: two
        sockets, one replay request.
        """
        key = source.key
        names = {(s.name, s.dp_rank is None) for s in self.sources.values()}
        if key in self.sources or (source.name, source.dp_rank is not None) in names:
            raise ValueError(f"source {key!r} is followed already (or its engine name is, "
                             "per rank or whole); unregister it first")
        if self.max_sources is not None and len(self.sources) >= self.max_sources:
            raise ValueError(self._full(len(self.sources) + 1))
        self._connect(source)
        self.sources[key] = source
        self.stats[key] = SourceStats()
        self._ahead[key] = {}
        self._heard[key] = time.monotonic()
        if self._hash_check is not None:
            self._hash_pending.add(key)
        self._unchecked.add(key)
        self._start_job(key, self._resync(key, "registered"), startup=True)

    def _full(self, count: int) -> str:
        return (f"{count} engines to follow, more than max_sources={self.max_sources} "
                "(sarp serve --max-engines): unregister one first, or raise the limit")

    def remove_source(self, key: str) -> None:
        """Stop following ``key`` (an engine that left): its sockets close, its replay
        job ends, and its holders are cleared, since the index must not claim blocks of
        an engine it no longer hears; its fingerprint is dropped.  KeyError if it is not
        followed.  Cost: a clear of its holders (their segments only).
        """
        self.sources[key]  # noqa: B018 - the KeyError says it is not followed
        job = self._jobs.get(key)
        if job is not None:
            job.gen.close()
            self._end_job(job, saving=False)
        self.flush()  # what was queued of it goes first, then its clear
        for instance in self._instances(key):
            self.index.clear(instance)
        self._disconnect(key)
        for table in (self.state, self._committed, self._dirty, self._ahead, self._heard,
                      self._live_last, self._retry_at, self._backoff, self.last_applied_at,
                      self._ranks, self.stats, self.sources):
            table.pop(key, None)
        for group in (self._verify, self._gone, self._unchecked, self._clean,
                      self._hash_pending):
            group.discard(key)
        self.save_state()

    @property
    def last_seq(self) -> dict[str, int]:
        """The last applied sequence of each source."""
        return {key: fp.seq for key, fp in self.state.items()}

    # -- state -------------------------------------------------------------------------------

    def save_state(self, durable: bool = False) -> None:
        """Write the fingerprints now (atomically; fsync when ``durable``)."""
        self._state_file.save(self._committed, durable=durable)

    # -- the loop ----------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> int:
        """Handle the messages that arrive within ``timeout_ms`` (live ones, and the
        replays' of the sources with a job), and those that arrive while the first of
        them waits ``commit_wait_ms`` for its commit; return batches applied, all of
        them committed.

        A write to the index that fails (``StoreError``: Valkey restarting, a full disk)
        stops nothing: what was not committed is dropped, every source is proven again
        from its last committed batch once a write goes through, and until then the
        messages wait in their sockets (retried after 0.25 s, doubling to 5 s).
        """
        now = time.monotonic()
        if now < self._store_retry_at:
            time.sleep(min(timeout_ms / 1000, self._store_retry_at - now))
            return 0
        try:
            applied = self._poll(timeout_ms)
        except StoreError as exc:
            self._store_failed(exc)
            return 0
        self._store_backoff = STORE_RETRY_S
        return applied

    def _store_failed(self, exc: StoreError) -> None:
        """Drop what was not committed; prove every source again from what was."""
        self.store_errors += 1
        fault_log.warn("index", "store_error", f"sarp: writing to the index failed ({exc});"
                        f" trying again in {self._store_backoff:g} s, then every engine is "
                        "proven again from its last committed batch")
        for job in list(self._jobs.values()):
            job.gen.close()
            self._end_job(job, saving=False)
        self.applier.discard()
        self.state = dict(self._committed)
        self._dirty.clear()
        self._queued_since, self._queued_fps = None, []
        for ahead in self._ahead.values():
            ahead.clear()
        self._verify.update(self.sources)
        self._store_retry_at = time.monotonic() + self._store_backoff
        self._store_backoff = min(2 * self._store_backoff, MAX_STORE_RETRY_S)

    def _poll(self, timeout_ms: int) -> int:
        applied = self._take(self._next_wait_ms(timeout_ms))
        if self._dry and (rest_s := self._commit_in_s()) > 0:
            # The sockets ran dry within the commit's wait: more gather in them
            # meanwhile, read at one wake-up (not one per message). Once: a backlog
            # never waits, and a poll returns.
            time.sleep(rest_s)
            applied += self._take(0)
        self.flush()
        self._state_file.due()
        return applied

    def _take(self, wait_ms: int) -> int:
        """What arrives within ``wait_ms``: connections, live messages (queued; committed
        within a batch when it is due), replays' frames, probes' answers."""
        applied = 0
        ready = dict(self._poller.poll(wait_ms))
        for monitor, key in self._monitors.items():  # connections first
            if monitor in ready:
                self._drain_monitor(monitor, key)
        for key in sorted(self._verify - self._jobs.keys()):
            # A new connection may be a new engine on the same port, whose first
            # batches went out before we were there: check now, not at its next batch.
            self._verify.discard(key)
            applied += self._start_job(key, self._resync(key, "reconnected"),
                                       startup=key in self._unchecked)
        # Round-robin over the sources with messages waiting, a few from each at a time,
        # so that one source's backlog neither delays the others nor reaches the index
        # long before theirs (a backlog applied in time order churns less: a block one
        # engine evicts while another still holds it keeps its segment).
        waiting = [(sock, key) for sock, key in self._subs.items()
                   if sock in ready and key not in self._jobs]
        budget = POLL_MESSAGES
        while waiting and budget > 0:
            still = []
            for sock, key in waiting:
                got, taken, more = self._round(sock, key)
                applied, budget = applied + got, budget - taken
                if more:
                    still.append((sock, key))
            waiting = still
        self._dry = not waiting
        if self._dry:
            self._batch_ms = MAX_BATCH_MS  # the sockets ran dry: caught up
        now = time.monotonic()
        applied += self._drive_jobs(ready, now) + self._retry_due(now)
        for sock in [sock for sock in self._probes if sock in ready]:
            self._on_probe_answer(sock)
        self._check_liveness()
        return applied

    def _rank(self, key: str) -> int | None:
        """The rank a source's batches go under: its own, or the one the last named."""
        own = self.sources[key].dp_rank
        return own if own is not None else self._ranks.get(key, 0)

    def _hashes_unchecked(self, key: str) -> bool:
        """Are its hashes still to be checked against its tokens (not a token-keyed
        engine's: those only link its blocks)?"""
        return key in self._hash_pending and self.sources[key].model is None

    def _commit_in_s(self) -> float:
        """How long the batches queued wait for more once the sockets ran dry (<= 0:
        now; at once too when the first came after a quiet spell: it is likely alone)."""
        first = self._queued_since
        if first is None or first - self._committed_at > self._commit_wait_s:
            return 0.0
        return first + self._commit_wait_s - time.monotonic()

    @property
    def caught_up(self) -> bool:
        """Has every source's start-up check (:meth:`start_catch_up`) ended?"""
        return not self._unchecked

    @property
    def replaying(self) -> list[str]:
        """The sources whose live stream waits for a replay now."""
        return sorted(self._jobs)

    def flush(self) -> bool:
        """Commit every queued batch in one index transaction; True if anything was.

        The fingerprints of those batches (``subscriber.json``) are written in the same
        transaction (:class:`~sarp.serving.sources.FingerprintFile`).
        """
        self._behind = False
        if not self._dirty and not self.applier.pending_ops:
            return False
        committed = {**self._committed, **self._dirty}
        if not self.applier.flush(self._state_file.state(committed)):
            self._state_file.save(committed)  # no commit took it (nothing to write)
        self.last_applied_at.update(dict.fromkeys(self._dirty, time.time()))
        self._committed = committed
        self._dirty.clear()
        self._queued_since, self._committed_at = None, time.monotonic()
        if self._on_commit is not None:
            fps, self._queued_fps = self._queued_fps, []
            self._on_commit(fps)
        return True

    def _maybe_flush(self) -> None:
        if self._queued_since is None:
            return
        waited_ms = 1000 * (time.monotonic() - self._queued_since)
        if waited_ms >= self._batch_ms:
            # Messages kept coming for that long without the sockets running dry: we
            # are behind, and a bigger batch catches up faster (more of what one
            # engine stores and another evicts meets inside it, never written).
            self._behind = self._flush_taking(MAX_BATCH_OPS)
            self._batch_ms = min(2 * self._batch_ms, MAX_CATCH_UP_MS)
        elif self._behind or self.applier.pending_ops >= MAX_BATCH_OPS:
            # (behind: the prefetch stopped with messages still in line, so what it
            # took is the next commit, written while it takes the one after)
            self._behind = self._flush_taking(MAX_BATCH_OPS)

    def start_catch_up(self) -> int:
        """Start proving each engine's continuity from its replay buffer (as jobs that
        :meth:`poll` feeds, so no engine waits for another's replay); returns the
        batches applied at once.  :attr:`caught_up` says when they have all ended.

        A SUB socket only sees messages published after it connects, so a
        (re)started subscriber asks first instead of waiting for a gap to show.
        """
        self._unchecked.update(self.sources)
        return sum(self._start_job(key, self._resync(key, "start"), startup=True)
                   for key in self.sources if key not in self._jobs)

    def catch_up(self, should_stop=lambda: False) -> int:
        """:meth:`start_catch_up`, then poll until every check has ended (or
        ``should_stop()``); the other sources' live batches are applied meanwhile."""
        applied = self.start_catch_up()
        while not self.caught_up and not should_stop():
            applied += self.poll(50)
        self.flush()
        self.save_state()
        return applied

    def run(self, should_stop=lambda: False, timeout_ms: int = 100) -> None:
        """Catch up, then poll until ``should_stop()`` is true; then save the state."""
        try:
            self.catch_up()
            while not should_stop():
                self.poll(timeout_ms)
        finally:
            self.flush()
            self.save_state(durable=True)

    def close(self) -> None:
        for job in list(self._jobs.values()):
            job.gen.close()  # what it applied stands; its replay socket closes
            self._end_job(job, saving=False)
        self.flush()
        self.save_state(durable=True)
        for sock in self._subs:
            sock.disable_monitor()
        for table in (self._subs, self._monitors, self._probes):
            for sock in table:
                sock.close(linger=0)
            table.clear()

    # -- live messages -----------------------------------------------------------------------

    def _on_message(self, key: str, frames: list[bytes]) -> int:
        """One live message: applied at once when it is the next batch in line, else
        handed to a job that proves continuity from the replay buffer first."""
        parsed = parse_frames(frames)
        if parsed is None or parsed[0] < 0:
            self._bad_frame(key, frames, None if parsed is None else parsed[0])
            return 0
        seq, payload = parsed
        self._heard[key] = time.monotonic()
        self._gone.discard(key)
        live_last = self._live_last.get(key)
        fp = self.state.get(key)
        if (live_last is None or seq > live_last) and seq == (0 if fp is None else fp.seq + 1):
            if self._in_columns(key, seq, payload, fp):
                return 1
            batch = self._decode(key, seq, payload)
            if batch is None or fp is None or batch.ts >= fp.ts - TS_SLACK_S:
                self._live_last[key] = seq
                self._drop_ahead(key, seq)
                return self._apply(key, seq, payload, frame_digest(payload), batch)
        return self._start_job(key, self._on_message_job(key, seq, payload, live_last))

    def _in_columns(self, key: str, seq: int, payload: bytes, fp: Fingerprint | None) -> bool:
        """The next batch in line, decoded in C into the commit's columns (a source
        without a rank of its own: under the rank the last batch named); False leaves it
        to :meth:`_decode` and :meth:`_apply` (another shape, rank, or a time gone back)."""
        source, rank = self.sources[key], self._rank(key)
        if self._hashes_unchecked(key):
            return False  # its hashes are checked against its tokens first
        got = self.applier.add_payload(payload, holder_name(source.name, rank),
                                        root=source.root, tokens=source.model is not None)
        if got is None:
            return False
        if got[2] != rank and source.dp_rank is None or fp is not None \
                and got[1] < fp.ts - TS_SLACK_S:
            self.applier.drop(got[0])  # another rank than the last's, or its time went back
            self._ranks[key] = got[2]
            return False
        self._live_last[key] = seq
        self._drop_ahead(key, seq)
        self.applier.keep(self.stats[key].applied, got[0])
        return self._queued(key, seq, [frame_digest(payload)], [got[1]], got[2]) == 1

    def _decode(self, key: str, seq: int, payload: bytes) -> Batch | None:
        try:  # token-keyed engines' stores need their tokens
            return decode(payload, self.sources[key].model is not None)
        except BadEvent as exc:
            self.stats[key].bad_payloads += 1
            fault_log.warn(key, "bad_payload", f"sarp: {key} seq {seq}: {exc}")
            return None

    def _apply(self, key: str, seq: int, payload: bytes, digest: int,
               batch: Batch | None) -> int:
        """Queue one batch in line for the next commit, and advance the fingerprint
        (``subscriber.json`` follows only when the commit is done: :meth:`flush`)."""
        source, stats = self.sources[key], self.stats[key]
        if batch is None:
            # A batch we cannot read may have removed blocks: it is a lost batch.
            self._forget(key, f"batch {seq} could not be decoded")
            self._advance(key, seq, [digest], [0.0])
            return 0
        if self._hashes_unchecked(key) and self._hash_check.check_batch(key, payload, batch,
                                                                       stats):
            self._hash_pending.discard(key)  # again after a clear (a restarted engine)
        self.applier.add(source.name, batch, stats.applied, dp_rank=source.dp_rank,
                          root=source.root)
        return self._queued(key, seq, [digest], [batch.ts], batch.dp_rank)

    def _queued(self, key: str, seq: int, digests: list[int], stamps: list[float],
                dp_rank: int | None) -> int:
        """Count the batches ``seq``, ``seq + 1``, ... (naming ``dp_rank``) queued; how many."""
        source, stats = self.sources[key], self.stats[key]
        if source.dp_rank is not None and dp_rank not in (None, source.dp_rank):
            stats.rank_mismatches += 1
        self._clean.discard(key)
        stats.batches += len(digests)
        self._advance(key, seq, digests, stamps)
        return len(digests)

    def _advance(self, key: str, seq: int, digests: list[int], stamps: list[float]) -> None:
        """The fingerprint after the batches ``seq``, ``seq + 1``, ... (their payloads'
        digests and timestamps) queued for the next commit."""
        old = self.state.get(key)
        prev = old.digest if old is not None and old.seq == seq - 1 else None
        if self._on_commit is not None:  # (each batch's, for its lag)
            fps = [Fingerprint(seq + i, d, t, digests[i - 1] if i else prev)
                   for i, (d, t) in enumerate(zip(digests, stamps, strict=True))]
            self._queued_fps += fps
            fp = fps[-1]
        else:
            fp = Fingerprint(seq + len(digests) - 1, digests[-1], stamps[-1],
                             digests[-2] if len(digests) > 1 else prev)
        self.state[key] = self._dirty[key] = fp
        if self._queued_since is None:
            self._queued_since = time.monotonic()
        ts = min((t for t in stamps if t), default=0.0)  # (0: a batch without its time)
        if ts and time.time() - ts > BEHIND_S and not (self._lane and self.prefetching):
            # Published that long ago (by the engine's clock: a skewed one only moves
            # this choice): we are behind, so batch for throughput from now on.  (With
            # a prefetch, the first commit comes soon and the next ones follow while
            # it is behind: the lane's decoding waits for none of them.)
            self._batch_ms = MAX_CATCH_UP_MS

    def summary(self) -> dict[str, dict]:
        """Each source's counters as plain values (JSON-ready: :func:`plain`, not
        ``dataclasses.asdict``), with its last sequence."""
        return {key: {**plain(s), "last_seq": self.last_seq.get(key)}
                for key, s in self.stats.items()}
