"""Replays: how serve asks an engine's replay endpoint for the batches it missed, and the
frames on both of serve's sockets.  A replay is a job of its own engine (a generator
fed by the subscriber's poll loop, :class:`Job`), so every other engine keeps being
applied meanwhile; each attempt has a budget (:class:`sarp.serving.sources.ReplayBudget`),
and a failed one clears that engine's holders and is retried with backoff.

:class:`ReplayJobs` is the replay half of :class:`sarp.serving.subscriber.Subscriber`
(it is mixed into it, and works on the subscriber's sources, sockets and state).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time

import zmq

from ..hashing import checksum
from .applier import RateLimitedLog
from .early import sub_socket
from .sources import Fingerprint, Source

log = logging.getLogger("sarp.subscriber")
fault_log = RateLimitedLog(log)  # faults from outside: counted, logged at a limited rate

END_OF_REPLAY = -1
NOBLOCK = int(zmq.NOBLOCK)
REPLAY_MESSAGES = 256  # replay messages a job takes per poll before the others' turn
FIRST_RETRY_S, MAX_RETRY_S = 1.0, 60.0  # backoff after a failed replay, doubling
PROBE_FROM = 1 << 62  # a liveness probe asks for sequences no engine has: only the end
REPLAY_RCVHWM = 1_000  # messages queued on our side of a replay (vLLM's ROUTER sends 1,000)
TS_SLACK_S = 1.0  # batch timestamps may step back this much (clock adjustments) unchecked


class ReplayJobs:
    """The replay half of the subscriber (see the module): replay jobs, the liveness
    probes that ask a silent engine's endpoint whether it is still there, what the SUB
    sockets' monitors say of their connections, and clearing an engine whose
    continuity cannot be proven."""

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

    def _on_live(self, key: str, seq: int, payload: bytes, checked: bool = False):
        """Place one live batch against the fingerprint; check continuity when in doubt
        (a generator: the checks wait on the replay endpoint)."""
        stats = self.stats[key]
        fp = self.state.get(key)
        expected = 0 if fp is None else fp.seq + 1
        digest = frame_digest(payload)
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
                try:
                    sock = self._ctx.socket(zmq.DEALER)
                except zmq.ZMQError as exc:  # out of descriptors: asked at a later check
                    fault_log.warn(key, "probe_socket", f"sarp: no socket to probe {key} "
                                   f"({exc})")
                    continue
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(source.replay_endpoint)
                # Nowhere to queue it (zmq.Again): no answer will come, and that decides.
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart([b"", PROBE_FROM.to_bytes(8, "big")], zmq.NOBLOCK)
                self._probes[sock] = (key, now)
                self._poller.register(sock, zmq.POLLIN)
                self.stats[key].probes += 1

    def _forget(self, key: str, reason: str) -> None:
        """Clear the source's holders: the index may know less than the engine, never more."""
        fault_log.warn(key, "cleared", f"sarp: {key}: {reason}; clearing its holders")
        if key not in self._clean:  # (a stream of bad batches clears once, not per batch)
            self.flush()  # what was queued before this happened goes first
            for instance in self._instances(key):
                self.index.clear(instance)
            self._clean.add(key)
        for table in (self.state, self._committed, self._dirty):
            table.pop(key, None)
        self._ahead[key].clear()
        if self._hash_check is not None:
            self._hash_pending.add(key)

    def _instances(self, key: str) -> list[str]:
        source = self.sources[key]
        names = {inst for inst, _ in self.index.holders_list()}
        if source.dp_rank is not None:
            return [key] if key in names else []
        return sorted(n for n in names if n == key or n.startswith(key + "#"))

    def _holds_anything(self, key: str) -> bool:
        self.flush()
        return any(self.index.blocks_of(inst).size for inst in self._instances(key))

    def _drop_ahead(self, key: str, seq: int) -> None:
        """Forget the replayed batches the live stream has passed."""
        ahead = self._ahead[key]
        if ahead:
            for old in [s for s in ahead if s < seq]:
                del ahead[old]

    def _connect(self, source: Source) -> None:
        """Its SUB socket and monitor; OSError, nothing left open, when out of sockets."""
        adopted = self._adopt.pop(source.endpoint, None)  # connected before serve's imports
        try:
            sock, monitor = adopted or sub_socket(self._ctx, source.endpoint,
                                                  self.max_frame_bytes)
        except zmq.ZMQError as exc:
            raise OSError(exc.errno, f"no sockets for engine {source.key} ({exc}), "
                          f"{len(self._subs)} followed: raise serve's open-files limit "
                          "(LimitNOFILE in its systemd unit, ulimit -n)") from None
        self._subs[sock] = source.key
        self._sub_of[source.key] = sock
        self._monitors[monitor] = source.key
        self._poller.register(monitor, zmq.POLLIN)
        self._poller.register(sock, zmq.POLLIN)

    def _disconnect(self, key: str) -> None:
        """Close a source's SUB socket, its monitor and any probe of its engine."""
        sock = self._sub_of.pop(key)
        monitor = next(m for m, k in self._monitors.items() if k == key)
        for s in (sock, monitor):
            with contextlib.suppress(KeyError):
                self._poller.unregister(s)
        sock.disable_monitor()
        sock.close(linger=0)
        monitor.close(linger=0)
        del self._subs[sock], self._monitors[monitor]
        for probe in [p for p, (k, _) in self._probes.items() if k == key]:
            self._end_probe(probe)

    def _drain_monitor(self, monitor: zmq.Socket, key: str) -> None:
        while monitor.poll(0):
            # libzmq's (u16 event, u32 value), endpoint; zmq.utils.monitor cost 30 ms a start
            frames = monitor.recv_multipart()
            event = {"event": struct.unpack("=hi", frames[0])[0] if len(frames[0]) == 6 else 0}
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
                # The poll that brought this event may have read the first frame of a
                # waiting message ahead; libzmq aborts the process (fq.cpp, `!_more`)
                # when the rest is dropped with the connection. Take that message
                # whole: the disconnect drops it and the rest of the queue anyway.
                with contextlib.suppress(zmq.ZMQError):
                    recv_message(sock.recv)
                with contextlib.suppress(zmq.ZMQError):
                    sock.disconnect(endpoint)
                sock.connect(endpoint)
                fault_log.warn(key, "disconnected",
                                f"sarp: {key}: connection dropped (the engine went away, or "
                                f"sent a frame over {self.max_frame_bytes} bytes)")

    def _bad_frame(self, key: str, frames: list[bytes], seq: int | None) -> None:
        self.stats[key].bad_frames += 1
        fault_log.warn(key, "bad_frame", f"sarp: {key} sent a bad frame ({len(frames)} parts"
                        f"{'' if seq is None else f', sequence {seq}'}); dropped")

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

    def _start_job(self, key: str, gen, startup: bool = False) -> int:
        """Run ``gen`` (a generator that yields the :class:`Replay` it waits on) as
        the source's job: its live stream is not read until the job ends, and the
        other sources go on meanwhile.  Returns the batches applied before its first
        wait."""
        job = Job(key, gen, time.monotonic() + self.replay_budget.seconds, startup)
        self._jobs[key] = job
        with contextlib.suppress(KeyError):
            self._poller.unregister(self._sub_of[key])
        return self._step(job, None)

    def _step(self, job: Job, frames: list[bytes] | None) -> int:
        """Resume a job with a message from its replay (None: its wait ran out)."""
        old = job.replay
        try:
            job.replay = job.gen.send(frames)
        except StopIteration as done:
            self._end_job(job)
            return done.value or 0
        except OSError as exc:  # no socket for its next replay: as a replay that failed
            job.replay = old
            self._abort_job(job, str(exc))
            return 0
        if job.replay is not old:
            if old is not None:
                self._poller.unregister(old.sock)
            self._poller.register(job.replay.sock, zmq.POLLIN)
        return 0  # what it applies is counted when it ends

    def _end_job(self, job: Job, saving: bool = True) -> None:
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

    def _abort_job(self, job: Job, reason: str) -> None:
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
                        frames = recv_message(recv)
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
            replay = Replay(self._ctx, self.sources[key].replay_endpoint, ask_from,
                             self.replay_idle_timeout_s, self.max_frame_bytes)
            progress = False
            try:
                while True:
                    frames = yield replay
                    if frames is None:
                        break  # went quiet
                    parsed = parse_frames(frames)
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
                        if not proves(head, *proof):
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
                    digest = frame_digest(payload)
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


class Replay:
    """One replay request in flight: a DEALER that asked an engine's buffer for every
    batch from ``start``; ``idle_until`` moves on with each useful frame only."""

    __slots__ = ("sock", "idle_s", "idle_until")

    def __init__(self, ctx: zmq.Context, endpoint: str, start: int, idle_s: float,
                 max_frame_bytes: int) -> None:
        try:
            self.sock = ctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:
            raise OSError(exc.errno, f"no socket for a replay from {endpoint} ({exc}): "
                          "serve is out of file descriptors") from None
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.idle_s = idle_s
        self.heard()
        try:
            self.sock.connect(endpoint)
            self.sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # nowhere to queue it: no answer will come
            fault_log.warn(endpoint, "replay_send", f"sarp: replay request to {endpoint} "
                            f"not sent ({exc})")

    def heard(self) -> None:
        self.idle_until = time.monotonic() + self.idle_s

    def close(self) -> None:
        self.sock.close(linger=0)


class Job:
    """A source's work that waits on its replay endpoint: a generator that yields the
    :class:`Replay` it waits on and is sent each message (None: the wait ran out)."""

    __slots__ = ("key", "gen", "until", "startup", "replay", "frames", "bytes")

    def __init__(self, key: str, gen, until: float, startup: bool) -> None:
        self.key, self.gen, self.until, self.startup = key, gen, until, startup
        self.replay: Replay | None = None
        self.frames = self.bytes = 0


def proves(frames: list[tuple[int, bytes]], fp: Fingerprint, back: int) -> bool:
    """Do the replay's first frames carry the batches the fingerprint names?"""
    if fp.digest is None or len(frames) < 1 + back:
        return False
    if back and (frames[0][0] != fp.seq - 1 or frame_digest(frames[0][1]) != fp.prev_digest):
        return False
    last = frames[back]
    return last[0] == fp.seq and frame_digest(last[1]) == fp.digest


def frame_digest(payload: bytes) -> int:
    """What a fingerprint keeps of a batch's payload (xxh3-64)."""
    return checksum(payload)


def recv_message(recv) -> list[bytes]:
    """The frames of the message waiting on a socket (``recv``: its bound method), or
    ``zmq.Again``: ``recv_multipart(NOBLOCK)`` without asking the socket for RCVMORE
    after each frame, where pyzmq builds an enum for every option it reads; a frame
    says itself whether more follow (0.1 µs less a Mooncake message, 1.2 µs a
    built-in one, of 5-7 µs, in a loopback micro-benchmark; docs/performance.md)."""
    frame = recv(NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = recv(NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


def parse_frames(frames: list[bytes]) -> tuple[int, bytes] | None:
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
