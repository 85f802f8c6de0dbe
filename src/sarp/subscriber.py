"""Following engines' KV event streams over ZeroMQ, and keeping the index right.

Each source is one engine (all its DP ranks): a SUB socket on its PUB endpoint,
frames ``(topic, 8-byte big-endian sequence, msgpack payload)``, and optionally
its replay endpoint (a ROUTER: send the first wanted sequence as 8 bytes from a
DEALER; it answers ``(seq, payload)`` frames, with or without a topic frame, and
ends with sequence -1).

Per source the subscriber tracks the last applied sequence:

* next in line: apply;
* a gap: replay from the first missing sequence before applying anything newer
  (live messages wait in the SUB socket's queue meanwhile, so a replayed store is
  always applied before a later live remove, never after);
* a gap the replay cannot fill (no replay endpoint, or the engine's buffer no
  longer reaches back): clear that engine's holders and go on from there; the index
  may then know less than the engine, never more;
* a sequence that goes backwards: the engine restarted, so its holders are cleared.

The last applied sequences are written to ``subscriber.json`` in the index
directory, so a restarted subscriber resumes where it stopped (re-applying a few
batches is harmless: every event sets or clears holder bits).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import zmq

from .events import ApplyStats, BadEvent, apply, decode

log = logging.getLogger("sarp.subscriber")

STATE_FILE = "subscriber.json"
END_OF_REPLAY = -1


@dataclass(frozen=True, slots=True)
class Source:
    """An engine to follow: its name (the holder) and its endpoints."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None

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


@dataclass(slots=True)
class SourceStats:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replayed: int = 0
    unrecoverable_gaps: int = 0
    restarts: int = 0
    bad_payloads: int = 0
    applied: ApplyStats = field(default_factory=ApplyStats)


class Subscriber:
    """Apply the KV events of ``sources`` to ``index``; see the module docstring.

    Cost: one index write per event; a replay round trip per gap.
    """

    def __init__(
        self,
        index,
        sources: list[Source],
        *,
        replay_timeout_s: float = 5.0,
        context: zmq.Context | None = None,
    ) -> None:
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be distinct, got {names}")
        self.index = index
        self.sources = {s.name: s for s in sources}
        self.replay_timeout_s = replay_timeout_s
        self._ctx = context or zmq.Context.instance()
        self._state_path = Path(index.path) / STATE_FILE
        self.last_seq: dict[str, int] = self._load_state()
        self.stats = {name: SourceStats() for name in self.sources}
        self._live_last: dict[str, int] = {}  # last sequence seen on the live stream
        self._replayed_upto: dict[str, int] = {}  # highest sequence a replay delivered
        self._subs: dict[zmq.Socket, str] = {}
        self._poller = zmq.Poller()
        for source in sources:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVHWM, 0)  # never drop on our side
            sock.connect(source.endpoint)
            self._subs[sock] = source.name
            self._poller.register(sock, zmq.POLLIN)

    # -- state -------------------------------------------------------------------------------

    def _load_state(self) -> dict[str, int]:
        try:
            state = json.loads(self._state_path.read_text())
            return {str(k): int(v) for k, v in state["last_seq"].items()}
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("sarp: ignoring unreadable %s (%s); starting fresh", self._state_path, exc)
            return {}

    def save_state(self, durable: bool = False) -> None:
        """Write the last applied sequences (atomically; fsync when ``durable``)."""
        tmp = self._state_path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"last_seq": self.last_seq}, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self._state_path)

    # -- the loop ----------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> int:
        """Handle every message that arrives within ``timeout_ms``; return batches applied."""
        applied = 0
        for sock, _ in self._poller.poll(timeout_ms):
            name = self._subs[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                applied += self._on_message(name, frames)
        if applied:
            self.save_state()
        return applied

    def catch_up(self) -> int:
        """Replay from each engine what came after our last applied batch.

        A SUB socket only sees messages published after it connects, so a
        (re)started subscriber asks first instead of waiting for a gap to show.
        """
        applied = sum(self._replay(name, self.last_seq.get(name, -1) + 1)
                      for name in self.sources)
        self.save_state()
        return applied

    def run(self, should_stop=lambda: False, timeout_ms: int = 100) -> None:
        """Catch up, then poll until ``should_stop()`` is true; then save the state."""
        try:
            self.catch_up()
            while not should_stop():
                self.poll(timeout_ms)
        finally:
            self.save_state(durable=True)

    def close(self) -> None:
        self.save_state(durable=True)
        for sock in self._subs:
            sock.close(linger=0)
        self._subs.clear()

    # -- one message -------------------------------------------------------------------------

    def _on_message(self, name: str, frames: list[bytes]) -> int:
        stats = self.stats[name]
        parsed = _parse_frames(frames)
        if parsed is None:
            stats.bad_payloads += 1
            log.warning("sarp: %s sent %d frames, expected (topic, seq, payload)", name,
                        len(frames))
            return 0
        seq, payload = parsed
        last = self.last_seq.get(name)
        live_last = self._live_last.get(name)
        self._live_last[name] = seq
        applied = 0
        if last is not None and seq <= last:
            went_back = live_last is not None and seq < live_last
            if not went_back and (seq == last or seq <= self._replayed_upto.get(name, -1)):
                stats.duplicates += 1  # already applied, e.g. through a replay
                return 0
            # The live stream went backwards, or the engine is behind what we applied
            # with no replay to explain it: the engine restarted.
            stats.restarts += 1
            log.warning("sarp: %s sequence went back from %d to %d: engine restarted; "
                        "clearing its holders", name, last, seq)
            self._clear_source(name)
            self._replayed_upto.pop(name, None)
            last = None
        expected = 0 if last is None else last + 1
        if seq > expected:
            stats.gaps += 1
            applied += self._replay(name, expected)
            last = self.last_seq.get(name)
            if last is not None and seq <= last:
                return applied  # the replay covered this one
            if seq > (0 if last is None else last + 1):
                self._give_up_gap(name, expected if last is None else last + 1, seq)
        return applied + self._apply(name, seq, payload)

    def _apply(self, name: str, seq: int, payload: bytes) -> int:
        stats = self.stats[name]
        self.last_seq[name] = seq
        try:
            batch = decode(payload)
        except BadEvent as exc:
            stats.bad_payloads += 1
            log.warning("sarp: %s seq %d: %s", name, seq, exc)
            return 0
        apply(self.index, name, batch, stats.applied)
        stats.batches += 1
        return 1

    def _replay(self, name: str, start: int) -> int:
        """Ask the engine for every batch from ``start``; apply the ones we lack."""
        source = self.sources[name]
        if source.replay_endpoint is None:
            return 0
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        applied = 0
        try:
            dealer.connect(source.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                remaining_ms = int(1000 * (deadline - time.monotonic()))
                if remaining_ms <= 0 or not dealer.poll(remaining_ms):
                    log.warning("sarp: replay from %s timed out", name)
                    break
                parsed = _parse_frames(dealer.recv_multipart())
                if parsed is None:
                    continue
                seq, payload = parsed
                if seq == END_OF_REPLAY:
                    break
                self._replayed_upto[name] = max(seq, self._replayed_upto.get(name, -1))
                last = self.last_seq.get(name)
                expected = 0 if last is None else last + 1
                if seq < expected:
                    continue
                if seq > expected:
                    self._give_up_gap(name, expected, seq)
                applied += self._apply(name, seq, payload)
                self.stats[name].replayed += 1
        finally:
            dealer.close(linger=0)
        return applied

    def _give_up_gap(self, name: str, missing_from: int, got: int) -> None:
        """Events ``missing_from .. got-1`` are gone: forget the engine, start over."""
        self.stats[name].unrecoverable_gaps += 1
        log.warning("sarp: %s events %d..%d cannot be replayed; clearing its holders so the "
                    "index never reports blocks the engine may have removed", name,
                    missing_from, got - 1)
        self._clear_source(name)

    def _clear_source(self, name: str) -> None:
        instances = {inst for inst, _ in self.index.holders_list()
                     if inst == name or inst.startswith(name + "#")}
        for instance in sorted(instances):
            self.index.clear(instance)
        self.last_seq.pop(name, None)

    def summary(self) -> dict[str, dict]:
        return {name: {**asdict(s), "last_seq": self.last_seq.get(name)}
                for name, s in self.stats.items()}


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
