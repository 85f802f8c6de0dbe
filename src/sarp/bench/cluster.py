"""A simulated serving cluster, for tests and demos of the event path end to end.

N engines, each with a bounded LRU block cache, serve a trace's requests; each
emits real msgpack KV events (vLLM's encoding) over real ZeroMQ sockets: a PUB
endpoint and a ROUTER replay endpoint with a buffer of past batches, as vLLM's
``ZmqEventPublisher`` does.  A router picks an engine per request: at random,
round-robin, or by sarp's scores.  Events can be dropped on purpose (published to
the replay buffer, not to PUB) to exercise gap replay.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from ..serving.events import ENCODING_STYLES, encode_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EnginePublisher:
    """PUB + ROUTER replay, bound on loopback (or ipc); replay served from a thread.

    The frames are vLLM's ``ZmqEventPublisher``'s: ``(topic, seq, payload)`` on PUB
    (topic ``b""``, sequence 8 bytes big-endian from 0); a replay request is the
    first wanted sequence, answered with every buffered batch from it and an end
    marker (sequence -1).  ``replay_topic`` picks the replay frames of vLLM 0.12
    on and SGLang (``"", topic, seq, payload``) instead of vLLM 0.11's (``"",
    seq, payload``).  The ROUTER keeps ZeroMQ's default send high-water mark, as
    vLLM 0.11 does, so a subscriber that reads a replay slowly loses part of it.
    """

    def __init__(self, context: zmq.Context, transport: str = "tcp", *,
                 buffer_batches: int = 100_000, ipc_dir: str | None = None,
                 name: str = "engine", replay_topic: bool = False,
                 bind: tuple[str, str] | None = None) -> None:
        self.context = context
        self.replay_topic = replay_topic
        if bind is not None:
            endpoints = bind
        elif transport == "tcp":
            endpoints = ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        elif transport == "ipc":
            if ipc_dir is None:
                raise ValueError("transport='ipc' needs ipc_dir")
            endpoints = (f"ipc://{ipc_dir}/{name}-pub", f"ipc://{ipc_dir}/{name}-replay")
        else:
            raise ValueError(f"transport={transport!r}; pass 'tcp' (loopback) or 'ipc'")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()
        self.next_seq = 0
        self.last_sent_seq = -1
        self.sent = 0
        self.dropped = 0
        self._open(*endpoints)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    def _open(self, endpoint: str, replay_endpoint: str) -> None:
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        _bind(self.pub, endpoint)
        self.router = self.context.socket(zmq.ROUTER)
        _bind(self.router, replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def _shut(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        self.pub.close(linger=0)
        self.router.close(linger=0)

    def publish(self, payload: bytes, drop: bool = False) -> int:
        seq = self.next_seq
        self.next_seq += 1
        with self._lock:
            self.buffer.append((seq, payload))
        if drop:
            self.dropped += 1
        else:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
            self.last_sent_seq = seq
            self.sent += 1
        return seq

    def restart(self, rebind: bool = False) -> None:
        """Forget everything, as a restarted engine does: sequences start again at 0.

        ``rebind`` also closes the sockets and binds new ones on the same
        endpoints, as a new engine process does: subscribers reconnect, and what
        is published before they do reaches nobody (it is in the buffer).
        """
        if rebind:
            self._shut()
        with self._lock:
            self.buffer.clear()
        self.next_seq = 0
        self.last_sent_seq = -1
        if rebind:
            self._open(self.endpoint, self.replay_endpoint)

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while self._running:
            if not poller.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                batches = [(s, p) for s, p in self.buffer if s >= first]
            topic = (b"",) if self.replay_topic else ()
            for seq, payload in batches:
                self.router.send_multipart((client, b"", *topic, seq.to_bytes(8, "big"),
                                            payload))
            self.router.send_multipart((client, b"", *topic, END_SEQ, b""))

    def close(self) -> None:
        self._shut()


def _bind(sock: zmq.Socket, endpoint: str, timeout_s: float = 5.0) -> None:
    """Bind, waiting out a port the previous (closed) socket has not released yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class HostileEngine:
    """An engine that attacks its subscriber, for fault tests and the soak: a PUB that
    publishes one batch at sequence 5 (so it needs a replay), and a replay ROUTER that
    answers every request with frames for ever and never its end: some of the wrong
    shape, most well-shaped with growing sequences and payloads that are not event
    batches, ``frame_bytes`` each."""

    def __init__(self, context: zmq.Context, frame_bytes: int = 16 << 10) -> None:
        ctx = context
        self.pub, self.router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.frame_bytes = frame_bytes
        self.requests = 0
        self.sent = 0
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        clients: list[bytes] = []
        seq = 0
        junk = b"\xc1" * self.frame_bytes  # 0xc1 is never valid msgpack
        while self._running:
            if self.router.poll(2):
                frames = self.router.recv_multipart()
                clients.append(frames[0])
                self.requests += 1
                if self.requests == 1:  # the live batch that asks for a replay
                    self.pub.send_multipart([b"", (5).to_bytes(8, "big"), encode_batch(
                        [("stored", [1, 2], None, "GPU")], ts=time.time())])
            for client in clients[-4:]:
                seq += 1
                with_shape = seq % 4 != 0
                parts = [client, b"", seq.to_bytes(8, "big"), junk] if with_shape \
                    else [client, b"garbage"]
                try:
                    self.router.send_multipart(parts, zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:
                    pass

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self.pub.close(linger=0)
        self.router.close(linger=0)


class SimEngine:
    """An engine with an LRU cache of ``capacity_blocks`` blocks that reports KV events.

    Serving a request: the longest cached prefix is reused; then every block is
    touched last block first (so parents stay more recent than children and the
    cache stays prefix-closed); blocks beyond the capacity are evicted least
    recently used first.  One event batch per request: the new blocks as one
    ``BlockStored`` (with their parent), then the evictions as ``BlockRemoved``.
    """

    def __init__(self, name: str, capacity_blocks: int, publisher: EnginePublisher,
                 medium: str = "GPU", dp_rank: int = 0) -> None:
        self.dp_rank = dp_rank
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.publisher = publisher
        self.medium = medium
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.requests = 0

    @property
    def holder(self) -> str:
        """The holder its blocks are under: engines always send their DP rank."""
        return f"{self.name}#{self.dp_rank}"

    def serve(self, chain: Sequence[int], drop: bool = False, style: str = "vllm-0.11") -> int:
        blocks = [int(h) for h in chain]
        hits = 0
        while hits < len(blocks) and blocks[hits] in self.cache:
            hits += 1
        for b in reversed(blocks):
            if b in self.cache:
                self.cache.move_to_end(b)
            else:
                self.cache[b] = None
        evicted = []
        while len(self.cache) > self.capacity_blocks:
            evicted.append(self.cache.popitem(last=False)[0])
        events = []
        if blocks[hits:]:
            # Report every new block, even one evicted in the same step, as engines do:
            # the store and its removal both reach the index, in order.
            events.append(("stored", blocks[hits:], blocks[hits - 1] if hits else None,
                           self.medium))
        if evicted:
            events.append(("removed", evicted, self.medium))
        if events:
            payload = encode_batch(events, ts=time.time(), dp_rank=self.dp_rank,
                                   style=style)  # stamped as engines stamp their batches
            self.publisher.publish(payload, drop=drop)
        self.requests += 1
        return hits


POLICIES = ("random", "round-robin", "sarp")
LOAD_SLACK = 1.1


@dataclass(slots=True)
class ClusterResult:
    policy: str
    requests: int
    blocks: int
    hit_blocks: int
    batches_dropped: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0


class Cluster:
    """Engines with publishers; :meth:`run` routes a trace through them."""

    def __init__(self, engines: int, capacity_blocks: int, *, transport: str = "tcp",
                 ipc_dir: str | None = None, context: zmq.Context | None = None) -> None:
        if engines < 1 or capacity_blocks < 1:
            raise ValueError("a cluster needs at least one engine and one block of capacity")
        self.context = context or zmq.Context.instance()
        self.engines = []
        for i in range(engines):
            pub = EnginePublisher(self.context, transport, ipc_dir=ipc_dir, name=f"e{i}")
            self.engines.append(SimEngine(f"e{i}", capacity_blocks, pub))

    def source_specs(self) -> list[str]:
        """``NAME=PUB,REPLAY`` for each engine, as ``sarp serve --source`` takes them."""
        return [f"{e.name}={e.publisher.endpoint},{e.publisher.replay_endpoint}"
                for e in self.engines]

    def run(
        self,
        requests: Sequence[np.ndarray],
        policy: str,
        *,
        index=None,
        sync: Callable[[], None] | None = None,
        drop_rate: float = 0.0,
        seed: int = 0,
        styles: Sequence[str] = ENCODING_STYLES,
    ) -> ClusterResult:
        """Route and serve ``requests``; ``sync()`` runs after each (e.g. let the
        subscriber catch up).  ``policy='sarp'`` needs ``index``.  Batches take the
        engines' encodings ``styles`` in turn."""
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}; pick from {POLICIES}")
        if policy == "sarp" and index is None:
            raise ValueError("policy='sarp' needs the index the subscriber keeps")
        from ..serving.router import score

        rng = random.Random(seed)
        hit_blocks = blocks = dropped = 0
        for i, chain in enumerate(requests):
            if policy == "random":
                engine = self.engines[rng.randrange(len(self.engines))]
            elif policy == "round-robin":
                engine = self.engines[i % len(self.engines)]
            else:
                engine = self._best(score(index, chain), rng)
            drop = drop_rate > 0 and rng.random() < drop_rate
            dropped += drop
            hit_blocks += engine.serve(chain, drop=drop, style=styles[i % len(styles)])
            blocks += len(chain)
            if sync is not None:
                sync()
        return ClusterResult(policy, len(requests), blocks, hit_blocks, dropped)

    def _best(self, scores, rng: random.Random) -> SimEngine:
        """The best prefix among engines not overloaded; else the least loaded.

        As KV-aware routers do, prefix reuse is weighed against load: an engine more
        than ``LOAD_SLACK`` above the mean request count is not a candidate, or the
        engine holding a popular shared prefix would get every request.
        """
        mean = sum(e.requests for e in self.engines) / len(self.engines)
        allowed = {e.name for e in self.engines if e.requests <= LOAD_SLACK * mean + 1}
        by_name = {e.name: e for e in self.engines}
        for s in scores:
            if s.engine in allowed and s.score > 0:
                return by_name[s.engine]
        least = min(e.requests for e in self.engines)
        return rng.choice([e for e in self.engines if e.requests == least])

    def close(self) -> None:
        for e in self.engines:
            e.publisher.close()


def simulate(
    requests: Sequence[np.ndarray],
    *,
    policies: Sequence[str] = POLICIES,
    engines: int = 4,
    capacity_blocks: int = 10_000,
    drop_rate: float = 0.01,
    workdir: str | None = None,
    seed: int = 0,
) -> list[dict]:
    """Run the trace once per policy, each with a fresh index and subscriber.

    Reports the cluster-wide prefix hit rate, the subscriber's event throughput
    (events and blocks applied per second of apply time), gaps replayed, and
    whether the index ended equal to the engines' caches.
    """
    import shutil
    import tempfile
    import time
    from pathlib import Path

    import sarp

    from ..serving.subscriber import Source, Subscriber

    out = []
    for policy in policies:
        cluster = Cluster(engines, capacity_blocks)
        folder = Path(tempfile.mkdtemp(prefix=f"sarp-cluster-{policy}-", dir=workdir))
        try:
            with sarp.open(folder / "ix", durability="nosync") as index:
                subscriber = Subscriber(index, [Source.parse(s) for s in cluster.source_specs()])
                time.sleep(0.2)  # let the SUB sockets connect

                def sync(subscriber=subscriber, cluster=cluster) -> None:
                    deadline = time.monotonic() + 5
                    while time.monotonic() < deadline:
                        subscriber.poll(2)
                        if all(subscriber.last_seq.get(e.name, -1) >= e.publisher.last_sent_seq
                               for e in cluster.engines):
                            return

                started = time.perf_counter()
                result = cluster.run(requests, policy, index=index, sync=sync,
                                     drop_rate=drop_rate, seed=seed)
                subscriber.catch_up()
                wall = time.perf_counter() - started
                stats = [s.applied for s in subscriber.stats.values()]
                seconds = sum(s.seconds for s in stats) or 1e-9
                equal = all(set(index.blocks_of(e.holder).tolist()) == set(e.cache)
                            for e in cluster.engines)
                out.append({
                    "policy": policy,
                    "requests": result.requests,
                    "blocks": result.blocks,
                    "hit_blocks": result.hit_blocks,
                    "hit_rate": result.hit_rate,
                    "batches_dropped": result.batches_dropped,
                    "gaps": sum(s.gaps for s in subscriber.stats.values()),
                    "events_per_s": sum(s.events for s in stats) / seconds,
                    "blocks_per_s": sum(s.blocks_stored + s.blocks_removed for s in stats)
                    / seconds,
                    "index_equals_caches": equal,
                    "wall_s": wall,
                })
                subscriber.close()
        finally:
            cluster.close()
            shutil.rmtree(folder, ignore_errors=True)
    return out
