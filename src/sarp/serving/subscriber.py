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

A replay never blocks the loop: it runs as the source's job (:class:`_Job`), fed by
:meth:`Subscriber.poll` as its frames arrive, while the other sources are followed;
frames are applied as they come, with a deadline per useful frame and a budget per
attempt (:class:`ReplayBudget`).  An attempt over budget, or without its end marker,
clears the source and is retried after a backoff.  A frame with a negative sequence,
or one the engine's own buffer does not know, is a bad frame: counted and dropped.
A batch that cannot be decoded is a lost batch (the holders are cleared); a bad event
inside a readable batch is skipped (:func:`sarp.serving.events.apply`).

An engine that dies stops publishing, but so does one that is idle.  So a source
with a replay endpoint that has sent nothing for ``probe_after_s`` is asked on it
(for sequences beyond any it has: the answer is just the end marker); an engine
that neither answers nor publishes within ``dead_after_s`` is taken as gone and its
holders are cleared.  If it answers later it is back: its buffer is replayed from sequence 0,
as for any engine the subscriber knows nothing about.  A source without a replay
endpoint cannot be asked, and keeps its holders until it publishes again.

The fingerprints are written to ``subscriber.json`` in the index directory after
what they describe has committed, so a restarted subscriber resumes where it
stopped (re-applying a batch is harmless: every event sets or clears holder bits).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import StoreError
from ..hashing import checksum
from .events import Applier, ApplyStats, BadEvent, Batch, RateLimitedLog, decode, holder_name

log = logging.getLogger("sarp.subscriber")

STATE_FILE = "subscriber.json"
STATE_VERSION = 2
END_OF_REPLAY = -1
TS_SLACK_S = 1.0  # batch timestamps may step back this much (clock adjustments) unchecked
MAX_BATCH_OPS = 16384  # events applied in one index transaction, at most
MAX_BATCH_MS = 20.0  # ... and how long the first of them may wait for the commit,
MAX_CATCH_UP_MS = 80.0  # ... doubled up to this while the sockets never run dry,
BEHIND_S = 1.0  # ... and this at once for a batch published longer ago than this
ROUND_MESSAGES = 8  # messages taken from one source before the next one's turn
_NOBLOCK = int(zmq.NOBLOCK)
_PROBE_FROM = 1 << 62  # a liveness probe asks for sequences no engine has: only the end
MAX_FRAME_BYTES = 64 << 20  # a frame over this is never received (vLLM's are KiB to MiB)
REPLAY_MESSAGES = 256  # replay messages a job takes per poll before the others' turn
POLL_MESSAGES = 65_536  # live messages one poll takes at most before the jobs' turn
FIRST_RETRY_S, MAX_RETRY_S = 1.0, 60.0  # backoff after a failed replay, doubling
STORE_RETRY_S, MAX_STORE_RETRY_S = 0.25, 5.0  # ... and after a failed write to the index
REPLAY_RCVHWM = 1_000  # messages queued on our side of a replay (vLLM's ROUTER sends 1,000)

_fault_log = RateLimitedLog(log)


@dataclass(frozen=True, slots=True)
class ReplayBudget:
    """What one replay attempt may take: wall time, frames and bytes received.

    A replay over budget (an endpoint that trickles garbage or never ends) is
    stopped, the source's holders are cleared, and the replay is tried again after a
    backoff.  The defaults leave room for an engine's whole buffer: vLLM keeps
    10,000 batches, and a subscriber takes about 50,000 a second.
    """

    seconds: float = 60.0
    frames: int = 2_000_000
    bytes: int = 4 << 30


class _Replay:
    """One replay request in flight: a DEALER that asked an engine's buffer for every
    batch from ``start``; ``idle_until`` moves on with each useful frame only."""

    __slots__ = ("sock", "idle_s", "idle_until")

    def __init__(self, ctx: zmq.Context, endpoint: str, start: int, idle_s: float,
                 max_frame_bytes: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.idle_s = idle_s
        self.heard()
        try:
            self.sock.connect(endpoint)
            self.sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # nowhere to queue it: no answer will come
            _fault_log.warn(endpoint, "replay_send", f"sarp: replay request to {endpoint} "
                            f"not sent ({exc})")

    def heard(self) -> None:
        self.idle_until = time.monotonic() + self.idle_s

    def close(self) -> None:
        self.sock.close(linger=0)


class _Job:
    """A source's work that waits on its replay endpoint: a generator that yields the
    :class:`_Replay` it waits on and is sent each message (None: the wait ran out)."""

    __slots__ = ("key", "gen", "until", "startup", "replay", "frames", "bytes")

    def __init__(self, key: str, gen, until: float, startup: bool) -> None:
        self.key, self.gen, self.until, self.startup = key, gen, until, startup
        self.replay: _Replay | None = None
        self.frames = self.bytes = 0


@dataclass(frozen=True, slots=True)
class Source:
    """An engine publisher to follow: the engine's name, its endpoints, its DP rank.

    Blocks are held by ``NAME#r``: ``r`` is ``dp_rank`` when the source was
    expanded per rank, else the rank each batch carries.
    """

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    dp_rank: int | None = None

    @property
    def key(self) -> str:
        """The source's name in stats and state: ``NAME``, or ``NAME#r`` per rank."""
        return holder_name(self.name, self.dp_rank)

    @classmethod
    def parse(cls, spec: str) -> Source:
        """``NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT]``.

        >>> Source.parse("w0=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558").replay_endpoint
        'tcp://127.0.0.1:5558'
        """
        name, sep, rest = spec.partition("=")
        endpoints = [e for e in rest.split(",") if e]
        if not sep or not name or not 1 <= len(endpoints) <= 2 or "#" in name:
            raise ValueError(
                f"source {spec!r}: write NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT], e.g. "
                "w0=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 (no '#' in NAME)"
            )
        return cls(name, endpoints[0], endpoints[1] if len(endpoints) == 2 else None)

    @classmethod
    def expand(cls, spec: str, dp_ranks: int | None = None) -> list[Source]:
        """One source per DP rank, on the ports the engines bind: base port + rank.

        vLLM and SGLang offset both endpoints' tcp port by the rank (``inproc``
        endpoints get a ``_dp{r}`` suffix).  ``dp_ranks=None`` gives the single
        source ``spec`` names.

        >>> [s.endpoint for s in Source.expand("e=tcp://10.0.0.5:5557", dp_ranks=2)]
        ['tcp://10.0.0.5:5557', 'tcp://10.0.0.5:5558']
        >>> Source.expand("e=tcp://10.0.0.5:5557", dp_ranks=2)[1].key
        'e#1'
        """
        base = cls.parse(spec)
        if dp_ranks is None:
            return [base]
        if isinstance(dp_ranks, bool) or not isinstance(dp_ranks, int) or dp_ranks < 1:
            raise ValueError(f"dp_ranks={dp_ranks!r}; pass the engine's DP size, an int >= 1")
        return [cls(base.name, rank_endpoint(base.endpoint, r),
                    None if base.replay_endpoint is None
                    else rank_endpoint(base.replay_endpoint, r), r)
                for r in range(dp_ranks)]


def rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint DP rank ``dp_rank`` of an engine binds, given rank 0's.

    >>> rank_endpoint("tcp://127.0.0.1:5557", 3), rank_endpoint("inproc://kv", 1)
    ('tcp://127.0.0.1:5560', 'inproc://kv_dp1')
    """
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    head, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit() and int(port) > 0:
        return f"{head}:{int(port) + dp_rank}"
    raise ValueError(
        f"endpoint {endpoint!r}: engines offset a tcp port (or an inproc name) per DP rank; "
        "for other endpoints pass one --source per rank"
    )


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What identifies the last applied batch of a source."""

    seq: int
    digest: int | None  # xxh3-64 of the payload; None when unknown (an old state file)
    ts: float
    # The digest of batch seq - 1, when it was applied just before: a proof checks
    # both, so one new-engine batch taken as a continuation before a reconnect was
    # noticed cannot prove itself.
    prev_digest: int | None = None


@dataclass(slots=True)
class SourceStats:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replayed: int = 0
    unrecoverable_gaps: int = 0
    restarts: int = 0
    continuity_checks: int = 0
    bad_payloads: int = 0
    bad_frames: int = 0
    rank_mismatches: int = 0
    probes: int = 0  # liveness probes sent after a silence
    disconnects: int = 0  # live connections dropped (engine gone, or a frame too large)
    failed_replays: int = 0  # replays over budget or without their end (cleared, retried)
    gone: int = 0  # times a probe went unanswered and the holders were cleared
    applied: ApplyStats = field(default_factory=ApplyStats)


class Subscriber:
    """Apply the KV events of ``sources`` to ``index``; see the module docstring.

    ``replay_idle_timeout_s`` is how long a replay may go without delivering a
    frame before it is taken as ended without its end marker.  ``on_commit``, if
    given, is called after each commit with the fingerprints of the batches it
    applied (for measuring publish-to-applied lag).  ``probe_after_s`` (None: never)
    and ``dead_after_s``: when a silent engine is asked whether it is still there,
    and how long it has to answer before its holders are cleared.
    ``max_frame_bytes``: a frame larger than this is never received (libzmq drops the
    connection, which reconnects; counted in ``disconnects``).  ``replay_budget``:
    what one replay attempt may take (:class:`ReplayBudget`).

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
    ) -> None:
        if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int) \
                or max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes={max_frame_bytes!r}; pass an int >= 1024")
        self.max_frame_bytes = max_frame_bytes
        self.replay_budget = replay_budget or ReplayBudget()
        keys = [s.key for s in sources]
        if len(set(keys)) != len(keys):
            raise ValueError(f"sources must be distinct, got {keys}")
        plain = {s.name for s in sources if s.dp_rank is None}
        if any(s.name in plain for s in sources if s.dp_rank is not None):
            raise ValueError(f"engine names must not be given both per rank and whole: {keys}")
        self.index = index
        self.sources = {s.key: s for s in sources}
        self.replay_idle_timeout_s = replay_idle_timeout_s
        self._ctx = context or zmq.Context.instance()
        self.state: dict[str, Fingerprint] = self._load_state()  # applied or queued
        self._committed: dict[str, Fingerprint] = dict(self.state)  # what subscriber.json says
        self._dirty: dict[str, Fingerprint] = {}  # queued, not yet committed
        self._applier = Applier(index)
        self._queued_since: float | None = None
        self._batch_ms = MAX_BATCH_MS  # the wait now allowed (longer while catching up)
        self._on_commit = on_commit  # called with the fingerprints of each commit's batches
        self._queued_fps: list[Fingerprint] = []
        self.stats = {key: SourceStats() for key in self.sources}
        self._live_last: dict[str, int] = {}  # last sequence seen on the live stream
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
        self._jobs: dict[str, _Job] = {}  # sources waiting on their replay endpoint
        self._retry_at: dict[str, float] = {}  # sources whose replay failed: when to retry
        self._backoff: dict[str, float] = {}  # the next wait after another failure
        self._subs: dict[zmq.Socket, str] = {}
        self._sub_of: dict[str, zmq.Socket] = {}
        self._monitors: dict[zmq.Socket, str] = {}
        self._poller = zmq.Poller()
        for source in sources:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVHWM, 0)  # never drop on our side
            sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(source.endpoint)
            self._subs[sock] = source.key
            self._sub_of[source.key] = sock
            self._monitors[monitor] = source.key
            self._poller.register(monitor, zmq.POLLIN)
            self._poller.register(sock, zmq.POLLIN)

    @property
    def last_seq(self) -> dict[str, int]:
        """The last applied sequence of each source."""
        return {key: fp.seq for key, fp in self.state.items()}

    # -- state -------------------------------------------------------------------------------

    def _load_state(self) -> dict[str, Fingerprint]:
        try:
            raw = self.index.read_state(STATE_FILE)
            if raw is None:
                return {}
            state = json.loads(raw)
            if "last_seq" in state:  # version 1: sequences only, continuity unprovable
                return {str(k): Fingerprint(int(v), None, 0.0)
                        for k, v in state["last_seq"].items()}
            return {str(k): Fingerprint(int(v["seq"]), v["digest"], float(v["ts"]),
                                        v.get("prev_digest"))
                    for k, v in state["sources"].items()}
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("sarp: ignoring unreadable %s of %s (%s); starting fresh", STATE_FILE,
                        self.index.path, exc)
            return {}

    def save_state(self, durable: bool = False) -> None:
        """Write the fingerprints (atomically; fsync when ``durable``)."""
        data = json.dumps({"version": STATE_VERSION,
                           "sources": {k: asdict(fp) for k, fp in self._committed.items()}})
        self.index.write_state(STATE_FILE, data.encode(), durable=durable)

    # -- the loop ----------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> int:
        """Handle the messages that arrive within ``timeout_ms`` (live ones, and the
        replays' of the sources with a job); return batches applied.

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
        _fault_log.warn("index", "store_error", f"sarp: writing to the index failed ({exc});"
                        f" trying again in {self._store_backoff:g} s, then every engine is "
                        "proven again from its last committed batch")
        for job in list(self._jobs.values()):
            job.gen.close()
            self._end_job(job, saving=False)
        self._applier.discard()
        self.state = dict(self._committed)
        self._dirty.clear()
        self._queued_since, self._queued_fps = None, []
        for ahead in self._ahead.values():
            ahead.clear()
        self._verify.update(self.sources)
        self._store_retry_at = time.monotonic() + self._store_backoff
        self._store_backoff = min(2 * self._store_backoff, MAX_STORE_RETRY_S)

    def _poll(self, timeout_ms: int) -> int:
        applied = 0
        ready = dict(self._poller.poll(self._next_wait_ms(timeout_ms)))
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
        waiting = [(sock.recv, key) for sock, key in self._subs.items()
                   if sock in ready and key not in self._jobs]
        budget = POLL_MESSAGES
        while waiting and budget > 0:
            still = []
            for recv, key in waiting:
                for _ in range(ROUND_MESSAGES):
                    try:
                        frames = _recv_message(recv)
                    except zmq.Again:
                        break
                    budget -= 1
                    applied += self._on_message(key, frames)
                    self._maybe_flush()
                    if key in self._jobs:
                        break  # its live stream waits for the replay
                else:
                    still.append((recv, key))
            waiting = still
        if not waiting:
            self._batch_ms = MAX_BATCH_MS  # the sockets ran dry: caught up
        now = time.monotonic()
        applied += self._drive_jobs(ready, now) + self._retry_due(now)
        for sock in [sock for sock in self._probes if sock in ready]:
            self._on_probe_answer(sock)
        self._check_liveness()
        self.flush()
        return applied

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

        Only then do the fingerprints of those batches go to ``subscriber.json``.
        """
        if not self._dirty and not self._applier.pending_ops:
            return False
        self._applier.flush()
        now = time.time()
        for key, fp in self._dirty.items():
            self._committed[key] = fp
            self.last_applied_at[key] = now
        self._dirty.clear()
        self._queued_since = None
        if self._on_commit is not None:
            fps, self._queued_fps = self._queued_fps, []
            self._on_commit(fps)
        self.save_state()
        return True

    def _maybe_flush(self) -> None:
        if self._queued_since is None:
            return
        waited_ms = 1000 * (time.monotonic() - self._queued_since)
        if waited_ms >= self._batch_ms:
            # Messages kept coming for that long without the sockets running dry: we
            # are behind, and a bigger batch catches up faster (more of what one
            # engine stores and another evicts meets inside it, never written).
            self.flush()
            self._batch_ms = min(2 * self._batch_ms, MAX_CATCH_UP_MS)
        elif self._applier.pending_ops >= MAX_BATCH_OPS:
            self.flush()

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
        for sock in [*self._subs, *self._monitors, *self._probes]:
            sock.close(linger=0)
        self._probes.clear()
        self._subs.clear()
        self._monitors.clear()

    # -- liveness ----------------------------------------------------------------------------

    def _check_liveness(self) -> None:
        """Ask silent engines whether they are there; clear the ones that do not answer."""
        if self.probe_after_s is None:
            return
        now = time.monotonic()
        asked = {key: (sock, at) for sock, (key, at) in self._probes.items()}
        for key, source in self.sources.items():
            if source.replay_endpoint is None:
                continue
            if key in asked:
                sock, at = asked[key]
                if self._heard[key] > at:  # it published (or answered a replay) since
                    self._end_probe(sock)
                elif now - at >= self.dead_after_s:
                    self._end_probe(sock)
                    self._heard[key] = now  # ask again after another silence
                    if key not in self._gone:
                        self._gone.add(key)
                        if key in self.state or self._holds_anything(key):
                            self.stats[key].gone += 1
                            self._forget(key, f"nothing heard for {self.probe_after_s:g} s "
                                              f"and no answer on its replay endpoint for "
                                              f"{self.dead_after_s:g} s: taken as gone")
            elif now - self._heard[key] >= self.probe_after_s:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(source.replay_endpoint)
                # Nowhere to queue it (zmq.Again): no answer will come, and that decides.
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart([b"", _PROBE_FROM.to_bytes(8, "big")], zmq.NOBLOCK)
                self._probes[sock] = (key, now)
                self._poller.register(sock, zmq.POLLIN)
                self.stats[key].probes += 1

    def _on_probe_answer(self, sock: zmq.Socket) -> None:
        key, _ = self._probes[sock]
        self._end_probe(sock)
        self._heard[key] = time.monotonic()
        if key in self._gone:
            # Back after being taken as gone (or a slow answer): what it holds now can
            # only be learned from its buffer, as for an engine never seen before.
            self._gone.discard(key)
            self._verify.add(key)

    def _end_probe(self, sock: zmq.Socket) -> None:
        self._poller.unregister(sock)
        del self._probes[sock]
        sock.close(linger=0)

    # -- one message -------------------------------------------------------------------------

    def _drain_monitor(self, monitor: zmq.Socket, key: str) -> None:
        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connects[key] += 1
                if self._connects[key] > 1:
                    self._verify.add(key)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                # libzmq drops a connection whose frame is over MAXMSGSIZE before it
                # allocates it, and does not reconnect after such a protocol error (it
                # does after the engine goes away): connect again ourselves.
                self.stats[key].disconnects += 1
                sock, endpoint = self._sub_of[key], self.sources[key].endpoint
                with contextlib.suppress(zmq.ZMQError):
                    sock.disconnect(endpoint)
                sock.connect(endpoint)
                _fault_log.warn(key, "disconnected",
                                f"sarp: {key}: connection dropped (the engine went away, or "
                                f"sent a frame over {self.max_frame_bytes} bytes)")

    def _bad_frame(self, key: str, frames: list[bytes], seq: int | None) -> None:
        self.stats[key].bad_frames += 1
        _fault_log.warn(key, "bad_frame", f"sarp: {key} sent a bad frame ({len(frames)} parts"
                        f"{'' if seq is None else f', sequence {seq}'}); dropped")

    def _on_message(self, key: str, frames: list[bytes]) -> int:
        """One live message: applied at once when it is the next batch in line, else
        handed to a job that proves continuity from the replay buffer first."""
        parsed = _parse_frames(frames)
        if parsed is None or parsed[0] < 0:
            self._bad_frame(key, frames, None if parsed is None else parsed[0])
            return 0
        seq, payload = parsed
        self._heard[key] = time.monotonic()
        self._gone.discard(key)
        live_last = self._live_last.get(key)
        fp = self.state.get(key)
        if (live_last is None or seq > live_last) and seq == (0 if fp is None else fp.seq + 1):
            batch = self._decode(key, seq, payload)
            if batch is None or fp is None or batch.ts >= fp.ts - TS_SLACK_S:
                self._live_last[key] = seq
                self._drop_ahead(key, seq)
                return self._apply(key, seq, payload, _digest(payload), batch)
        return self._start_job(key, self._on_message_job(key, seq, payload, live_last))

    def _on_message_job(self, key: str, seq: int, payload: bytes, live_last: int | None):
        """The live message that needs a replay first (a generator run as a job)."""
        self._live_last[key] = seq
        self._rejected = False
        applied = 0
        if live_last is not None and seq <= live_last:
            # One engine's PUB stream only goes forward: this is a new engine.
            applied += (yield from self._resync(
                key, f"live sequence went back from {live_last} to {seq}", known_restart=True))
        else:
            self._drop_ahead(key, seq)
        applied += yield from self._on_live(key, seq, payload)
        if self._rejected and live_last is not None:
            self._live_last[key] = live_last  # a bad frame does not move the live stream
        return applied

    def _drop_ahead(self, key: str, seq: int) -> None:
        """Forget the replayed batches the live stream has passed."""
        ahead = self._ahead[key]
        if ahead:
            for old in [s for s in ahead if s < seq]:
                del ahead[old]

    def _on_live(self, key: str, seq: int, payload: bytes, checked: bool = False):
        """Place one live batch against the fingerprint; check continuity when in doubt
        (a generator: the checks wait on the replay endpoint)."""
        stats = self.stats[key]
        fp = self.state.get(key)
        expected = 0 if fp is None else fp.seq + 1
        digest = _digest(payload)
        if seq < expected:
            if self._ahead[key].pop(seq, None) == digest:
                stats.duplicates += 1  # applied already, through a replay
                return 0
            if checked:
                stats.duplicates += 1  # older than what a proven replay applied
                return 0
            applied = yield from self._resync(key, f"sequence {seq} is not the batch applied "
                                                   f"as {seq}")
            return applied + (yield from self._on_live(key, seq, payload, checked=True))
        if seq > expected:
            if not checked:
                stats.gaps += 1
                applied, newest = yield from self._resync_newest(
                    key, f"gap: {expected}..{seq - 1} missing")
                if newest is not None and newest < seq:
                    self._rejected = True
                    self._bad_frame(key, [payload], seq)  # the engine's buffer never had it
                    return applied
                return applied + (yield from self._on_live(key, seq, payload, checked=True))
            self._give_up_gap(key, expected, seq)
        batch = self._decode(key, seq, payload)
        if (batch is not None and fp is not None and not checked
                and batch.ts < fp.ts - TS_SLACK_S):
            applied = yield from self._resync(
                key, f"batch {seq} is {fp.ts - batch.ts:.1f} s older than batch {fp.seq}")
            return applied + (yield from self._on_live(key, seq, payload, checked=True))
        return self._apply(key, seq, payload, digest, batch)

    def _decode(self, key: str, seq: int, payload: bytes) -> Batch | None:
        try:
            return decode(payload)
        except BadEvent as exc:
            self.stats[key].bad_payloads += 1
            _fault_log.warn(key, "bad_payload", f"sarp: {key} seq {seq}: {exc}")
            return None

    def _apply(self, key: str, seq: int, payload: bytes, digest: int,
               batch: Batch | None) -> int:
        """Queue one batch in line for the next commit, and advance the fingerprint
        (``subscriber.json`` follows only when the commit is done: :meth:`flush`)."""
        source, stats = self.sources[key], self.stats[key]
        if batch is None:
            # A batch we cannot read may have removed blocks: it is a lost batch.
            self._forget(key, f"batch {seq} could not be decoded")
            self._advance(key, seq, digest, 0.0)
            return 0
        if source.dp_rank is not None and batch.dp_rank not in (None, source.dp_rank):
            stats.rank_mismatches += 1
        self._applier.add(source.name, batch, stats.applied, dp_rank=source.dp_rank)
        self._clean.discard(key)
        stats.batches += 1
        self._advance(key, seq, digest, batch.ts)
        return 1

    def _advance(self, key: str, seq: int, digest: int, ts: float) -> None:
        old = self.state.get(key)
        fp = Fingerprint(seq, digest, ts,
                         old.digest if old is not None and old.seq == seq - 1 else None)
        self.state[key] = self._dirty[key] = fp
        if self._on_commit is not None:
            self._queued_fps.append(fp)
        if self._queued_since is None:
            self._queued_since = time.monotonic()
        if ts and time.time() - ts > BEHIND_S:
            # Published that long ago (by the engine's clock: a skewed one only moves
            # this choice): we are behind, so batch for throughput from now on.
            self._batch_ms = MAX_CATCH_UP_MS

    # -- jobs: what waits on a replay endpoint -------------------------------------------------

    def _start_job(self, key: str, gen, startup: bool = False) -> int:
        """Run ``gen`` (a generator that yields the :class:`_Replay` it waits on) as
        the source's job: its live stream is not read until the job ends, and the
        other sources go on meanwhile.  Returns the batches applied before its first
        wait."""
        job = _Job(key, gen, time.monotonic() + self.replay_budget.seconds, startup)
        self._jobs[key] = job
        with contextlib.suppress(KeyError):
            self._poller.unregister(self._sub_of[key])
        return self._step(job, None)

    def _step(self, job: _Job, frames: list[bytes] | None) -> int:
        """Resume a job with a message from its replay (None: its wait ran out)."""
        old = job.replay
        try:
            job.replay = job.gen.send(frames)
        except StopIteration as done:
            self._end_job(job)
            return done.value or 0
        if job.replay is not old:
            if old is not None:
                self._poller.unregister(old.sock)
            self._poller.register(job.replay.sock, zmq.POLLIN)
        return 0  # what it applies is counted when it ends

    def _end_job(self, job: _Job, saving: bool = True) -> None:
        if job.replay is not None:
            with contextlib.suppress(KeyError):
                self._poller.unregister(job.replay.sock)
            job.replay.close()
            job.replay = None
        self._jobs.pop(job.key, None)
        self._poller.register(self._sub_of[job.key], zmq.POLLIN)
        if not saving:
            return
        if job.startup:
            self._unchecked.discard(job.key)
        if job.startup and self.caught_up:
            self.flush()
            self.save_state()  # every source checked: subscriber.json says so

    def _abort_job(self, job: _Job, reason: str) -> None:
        """Stop a job that went over its budget: the source is cleared and retried later."""
        job.gen.close()  # its replay socket closes in the generator's finally
        self._end_job(job)
        self._replay_failed(job.key, reason)

    def _drive_jobs(self, ready: dict, now: float) -> int:
        """Feed each job what its replay sent (a bounded number of messages each), or
        its timeout; stop the jobs over budget."""
        applied = 0
        budget = self.replay_budget
        for job in list(self._jobs.values()):
            replay = job.replay
            if replay is None:
                continue
            if replay.sock in ready:
                recv = replay.sock.recv
                for _ in range(REPLAY_MESSAGES):
                    try:
                        frames = _recv_message(recv)
                    except zmq.Again:
                        break
                    job.frames += 1
                    job.bytes += sum(len(f) for f in frames)
                    applied += self._step(job, frames)
                    if job.replay is not replay:
                        break
            elif now >= replay.idle_until:
                applied += self._step(job, None)
            if self._jobs.get(job.key) is not job:
                continue
            over = ("seconds" if now > job.until else "frames" if job.frames > budget.frames
                    else "bytes" if job.bytes > budget.bytes else None)
            if over is not None:
                self._abort_job(job, f"its replay went over its budget of {over} "
                                     f"({budget.seconds:g} s, {budget.frames} frames, "
                                     f"{budget.bytes} bytes)")
        return applied

    def _next_wait_ms(self, timeout_ms: int) -> int:
        """``timeout_ms``, or less when a job's replay runs out of time sooner."""
        if not self._jobs and not self._retry_at:
            return timeout_ms
        now = time.monotonic()
        soonest = min([job.replay.idle_until for job in self._jobs.values()
                       if job.replay is not None] + [job.until for job in self._jobs.values()]
                      + list(self._retry_at.values()) + [now + timeout_ms / 1000])
        return max(0, min(timeout_ms, int(1000 * (soonest - now)) + 1))

    def _retry_due(self, now: float) -> int:
        """Start the replays whose backoff after a failure is over."""
        applied = 0
        for key in [k for k, at in self._retry_at.items() if at <= now and k not in self._jobs]:
            del self._retry_at[key]
            applied += self._start_job(key, self._retry_job(key))
        return applied

    def _retry_job(self, key: str):
        # what was applied since the failure rests on a clear: start over from the buffer
        self._forget(key, "retrying its replay")
        applied, _ = yield from self._resync_newest(key, "retry after a failed replay")
        return applied

    def _replay_failed(self, key: str, reason: str) -> None:
        """Clear the source and ask its buffer again after a backoff (doubling to
        ``MAX_RETRY_S``); until then it is followed as a source without a replay."""
        self.stats[key].failed_replays += 1
        self._forget(key, reason)
        backoff = self._backoff.get(key, FIRST_RETRY_S)
        self._retry_at[key] = time.monotonic() + backoff
        self._backoff[key] = min(2 * backoff, MAX_RETRY_S)

    # -- continuity --------------------------------------------------------------------------

    def _resync(self, key: str, reason: str, known_restart: bool = False):
        return (yield from self._resync_newest(key, reason, known_restart))[0]

    def _resync_newest(self, key: str, reason: str, known_restart: bool = False):
        """Prove continuity from the replay buffer and apply what follows, or start over
        (a generator).

        Returns the batches applied and the newest sequence the engine's buffer
        holds (None when unknown).
        """
        source, stats = self.sources[key], self.stats[key]
        stats.continuity_checks += 1
        fp = self.state.get(key)
        if known_restart:
            stats.restarts += 1
            self._forget(key, reason)
            fp = None
        if source.replay_endpoint is None or key in self._retry_at:
            if fp is not None or self._holds_anything(key):
                stats.unrecoverable_gaps += 1
                why = "no replay endpoint" if source.replay_endpoint is None \
                    else "its replay failed, and is retried later"
                self._forget(key, f"{reason}; {why} to prove continuity")
            return 0, None
        if fp is None:
            if self._holds_anything(key):
                self._forget(key, f"{reason}: nothing recorded proves what the index holds")
            outcome, applied, newest = yield from self._replay(key, 0, None)
        else:
            back = 1 if fp.prev_digest is not None and fp.seq > 0 else 0
            outcome, applied, newest = yield from self._replay(key, fp.seq - back, (fp, back))
            if outcome == "silent":
                stats.unrecoverable_gaps += 1
                self._replay_failed(key, f"{reason}: the replay endpoint did not answer")
                return applied, None
            if outcome in ("unproven", "empty"):
                if outcome == "empty" or newest == fp.seq - back:
                    stats.restarts += 1
                    why = "engine restarted"
                else:
                    stats.unrecoverable_gaps += 1
                    why = "its buffer no longer reaches back"
                self._forget(key, f"{reason}: continuity after batch {fp.seq} not proven "
                                  f"({why})")
                outcome, applied, newest = yield from self._replay(key, 0, None)
        if outcome != "ended":
            self._replay_failed(key, f"{reason}: the replay ended without its end marker")
            return applied, None
        self._backoff.pop(key, None)
        if newest is None:
            fp = self.state.get(key)
            newest = fp.seq if fp is not None else -1
        return applied, newest

    def _replay(self, key: str, start: int, proof: tuple[Fingerprint, int] | None):
        """Ask the engine's buffer for every batch from ``start`` and apply each as it
        arrives (a generator); with ``proof``, its first frames must carry the
        batches the fingerprint names before anything is applied.

        Returns ``(outcome, applied, newest)``: ``"ended"`` (the end marker came;
        newest is the last sequence sent, None if none), ``"empty"`` (the end marker
        before any frame of a proof), ``"unproven"`` (the first frames prove nothing;
        newest is the first one's sequence), ``"silent"`` (no answer) or
        ``"stopped"`` (no end marker).  A replay that arrives with a hole (the
        engine's ROUTER dropped frames at its send high-water mark, 1,000 in vLLM
        0.11), or that goes quiet before its end, is asked again from the first batch
        missing, as long as each answer makes progress; a frame of the wrong shape or
        out of order is a bad frame and does not count as progress.
        """
        stats = self.stats[key]
        applied, last, head = 0, None, []
        ask_from, first_ask = start, True
        while True:
            replay = _Replay(self._ctx, self.sources[key].replay_endpoint, ask_from,
                             self.replay_idle_timeout_s, self.max_frame_bytes)
            progress = False
            try:
                while True:
                    frames = yield replay
                    if frames is None:
                        break  # went quiet
                    parsed = _parse_frames(frames)
                    if parsed is None:
                        self._bad_frame(key, frames, None)
                        continue
                    seq, payload = parsed
                    if seq == END_OF_REPLAY:
                        if proof is not None:
                            return ("unproven" if head else "empty"), applied, \
                                head[0][0] if head else None
                        return "ended", applied, last
                    if seq < ask_from or (last is not None and seq <= last):
                        self._bad_frame(key, frames, seq)
                        continue
                    replay.heard()
                    self._heard[key] = time.monotonic()  # an answer: the engine is there
                    if proof is not None:
                        head.append((seq, payload))
                        last = seq
                        if len(head) < 1 + proof[1]:
                            continue
                        if not _proves(head, *proof):
                            return "unproven", applied, head[0][0]
                        proof, progress = None, True
                        continue
                    fp = self.state.get(key)
                    expected = 0 if fp is None else fp.seq + 1
                    if seq > expected and not (ask_from == expected and not progress):
                        ask_from = expected  # a hole: ask again from it
                        break
                    last, progress = seq, True
                    if seq < expected:
                        continue
                    if seq > expected:  # asked from it, and the buffer no longer has it
                        self._give_up_gap(key, expected, seq)
                    digest = _digest(payload)
                    applied += self._apply(key, seq, payload, digest,
                                           self._decode(key, seq, payload))
                    self._ahead[key][seq] = digest
                    stats.replayed += 1
                    self._maybe_flush()
            finally:
                replay.close()
            if not progress:
                return ("silent" if first_ask and last is None else "stopped"), applied, last
            if frames is None:
                fp = self.state.get(key)
                ask_from = 0 if fp is None else fp.seq + 1
            first_ask = False

    def _give_up_gap(self, key: str, missing_from: int, got: int) -> None:
        """Events ``missing_from .. got-1`` are gone: forget the engine, start over."""
        self.stats[key].unrecoverable_gaps += 1
        self._forget(key, f"events {missing_from}..{got - 1} cannot be replayed")

    def _forget(self, key: str, reason: str) -> None:
        """Clear the source's holders: the index may know less than the engine, never more."""
        _fault_log.warn(key, "cleared", f"sarp: {key}: {reason}; clearing its holders")
        if key not in self._clean:  # (a stream of bad batches clears once, not per batch)
            self.flush()  # what was queued before this happened goes first
            for instance in self._instances(key):
                self.index.clear(instance)
            self._clean.add(key)
        for table in (self.state, self._committed, self._dirty):
            table.pop(key, None)
        self._ahead[key].clear()

    def _instances(self, key: str) -> list[str]:
        source = self.sources[key]
        names = {inst for inst, _ in self.index.holders_list()}
        if source.dp_rank is not None:
            return [key] if key in names else []
        return sorted(n for n in names if n == key or n.startswith(key + "#"))

    def _holds_anything(self, key: str) -> bool:
        self.flush()
        return any(self.index.blocks_of(inst).size for inst in self._instances(key))

    def summary(self) -> dict[str, dict]:
        """Each source's counters as plain values (JSON-ready), with its last sequence.

        Not ``dataclasses.asdict``: it rebuilds a ``Counter`` from ``(key, value)``
        pairs, which counts the pairs, and ``json.dumps`` then refuses the tuple keys
        (a single bad event stopped ``serve --http``; tests/test_hardening.py).
        """
        return {key: {**_plain(s), "last_seq": self.last_seq.get(key)}
                for key, s in self.stats.items()}


def _plain(obj) -> dict:
    """A dataclass's fields, nested dataclasses and counters as plain dicts."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Counter):
            value = {str(k): int(v) for k, v in value.items()}
        elif hasattr(value, "__dataclass_fields__"):
            value = _plain(value)
        out[f.name] = value
    return out


def _proves(frames: list[tuple[int, bytes]], fp: Fingerprint, back: int) -> bool:
    """Do the replay's first frames carry the batches the fingerprint names?"""
    if fp.digest is None or len(frames) < 1 + back:
        return False
    if back and (frames[0][0] != fp.seq - 1 or _digest(frames[0][1]) != fp.prev_digest):
        return False
    last = frames[back]
    return last[0] == fp.seq and _digest(last[1]) == fp.digest


def _digest(payload: bytes) -> int:
    return checksum(payload)


def _recv_message(recv) -> list[bytes]:
    """The frames of the message waiting on a socket (``recv``: its bound method), or
    ``zmq.Again``: ``recv_multipart(NOBLOCK)`` without asking the socket for RCVMORE
    after each frame, where pyzmq builds an enum for every option it reads; a frame
    says itself whether more follow (0.1 µs less a Mooncake message, 1.2 µs a
    built-in one, of 5-7 µs, in a loopback micro-benchmark; docs/performance.md)."""
    frame = recv(_NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = recv(_NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


def _parse_frames(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) from ``[topic,] seq, payload`` with an optional leading empty frame."""
    if len(frames) == 4 and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8:
        frames = frames[1:]  # a DEALER reply: empty delimiter, seq, payload
    if len(frames) == 3:
        frames = frames[1:]  # topic, seq, payload
    if len(frames) != 2 or len(frames[0]) != 8:
        return None
    return int.from_bytes(frames[0], "big", signed=True), frames[1]
