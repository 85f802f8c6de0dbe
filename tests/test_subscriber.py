"""The subscriber against engines that misbehave, restart and flood: real ZeroMQ sockets
on loopback, publishers framing exactly as vLLM's and SGLang's ``ZmqEventPublisher``
(``sarp.bench.cluster.EnginePublisher``), engines with real LRU caches (``SimEngine``).

The rule every test checks: the index may know less than an engine, never more; and
where the engine's replay buffer allows it, exactly what the engine holds."""

from __future__ import annotations

import os
import random
import socket
import time

import numpy as np
import pytest
import servekit
import zmq

import sarp
from sarp.bench.cluster import EnginePublisher, SimEngine
from sarp.serving import inline
from sarp.serving.applier import Applier, ApplyStats
from sarp.serving.events import decode, encode_batch
from sarp.serving.subscriber import Source, Subscriber


def chains(seed: int, n: int, length: int = 6) -> list[list[int]]:
    """Requests: chains sharing prefixes, hashes spread like an engine's."""
    rng = random.Random(seed)
    roots = [[rng.getrandbits(63) for _ in range(3)] for _ in range(5)]
    return [rng.choice(roots) + [rng.getrandbits(63) for _ in range(length)] for _ in range(n)]


def engine(name: str = "e", capacity: int = 60, **kw) -> SimEngine:
    return SimEngine(name, capacity, EnginePublisher(zmq.Context.instance(), **kw))


def wait_applied(subscriber: Subscriber, key: str, publisher: EnginePublisher,
                 timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        subscriber.poll(5)
        if subscriber.last_seq.get(key, -1) >= publisher.next_seq - 1:
            return
    raise AssertionError(f"{key}: applied {subscriber.last_seq.get(key)}, "
                         f"engine at {publisher.next_seq - 1}")


def settle(subscriber: Subscriber, timeout_s: float = 30.0) -> None:
    """Poll until no source waits on a replay (they run as jobs the polls feed)."""
    deadline = time.monotonic() + timeout_s
    subscriber.poll(10)
    while subscriber.replaying and time.monotonic() < deadline:
        subscriber.poll(10)
    assert not subscriber.replaying, subscriber.replaying


def held(index, holder: str) -> set[int]:
    return set(index.blocks_of(holder).tolist())


@pytest.fixture
def index(tmp_path):
    ix = sarp.open(tmp_path / "ix", durability="nosync")
    yield ix
    ix.close()


def subscribe(index, eng: SimEngine, **kw) -> Subscriber:
    pub = eng.publisher
    sub = Subscriber(index, [Source(eng.name, pub.endpoint, pub.replay_endpoint)], **kw)
    time.sleep(0.2)  # let the SUB socket connect
    return sub


def test_a_negative_sequence_is_a_bad_frame_not_a_restart(index):
    eng = engine()
    try:
        sub = subscribe(index, eng)
        for chain in chains(1, 20):
            eng.serve(chain)
        wait_applied(sub, "e", eng.publisher)
        before = held(index, eng.holder)
        assert before == set(eng.cache)
        payload = encode_batch([("cleared",)], dp_rank=0)
        eng.publisher.pub.send_multipart([b"", (-5).to_bytes(8, "big", signed=True), payload])
        eng.publisher.pub.send_multipart([b"", (-1).to_bytes(8, "big", signed=True), b""])
        for chain in chains(2, 5):
            eng.serve(chain)
        wait_applied(sub, "e", eng.publisher)
        stats = sub.stats["e"]
        assert stats.bad_frames == 2 and stats.restarts == 0
        assert held(index, eng.holder) == set(eng.cache)
        sub.close()
    finally:
        eng.publisher.close()


def test_a_frame_beyond_the_engines_buffer_is_dropped(index):
    eng = engine()
    try:
        sub = subscribe(index, eng)
        for chain in chains(3, 10):
            eng.serve(chain)
        wait_applied(sub, "e", eng.publisher)
        eng.publisher.pub.send_multipart([b"", (10**12).to_bytes(8, "big"),
                                          encode_batch([("cleared",)], dp_rank=0)])
        for chain in chains(4, 5):
            eng.serve(chain)
        wait_applied(sub, "e", eng.publisher)
        assert sub.stats["e"].bad_frames == 1 and sub.stats["e"].restarts == 0
        assert held(index, eng.holder) == set(eng.cache) != set()
        sub.close()
    finally:
        eng.publisher.close()


@pytest.mark.parametrize("replay_topic", [False, True], ids=["vllm-0.11-replay",
                                                            "vllm-0.33-sglang-replay"])
def test_an_engine_restart_while_the_subscriber_is_down_past_the_old_sequence(index,
                                                                             replay_topic):
    # Replay frames with and without the topic frame, as each engine version sends them.
    eng = engine(replay_topic=replay_topic)
    try:
        sub = subscribe(index, eng)
        for chain in chains(5, 30):
            eng.serve(chain)
        wait_applied(sub, "e", eng.publisher)
        old_last = eng.publisher.next_seq - 1
        sub.close()  # serve stops; its fingerprint of batch old_last is on disk
        eng.cache.clear()
        eng.publisher.restart()  # a new engine: sequences from 0, a new buffer
        for chain in chains(6, 45):
            eng.serve(chain)
        assert eng.publisher.next_seq - 1 > old_last  # the new engine passed the old sequence
        sub = subscribe(index, eng)
        sub.catch_up()
        wait_applied(sub, "e", eng.publisher)
        assert sub.stats["e"].restarts == 1
        assert held(index, eng.holder) == set(eng.cache)
        sub.close()
    finally:
        eng.publisher.close()


@pytest.mark.parametrize("published_while_away", ["past", "exactly_next"])
def test_an_engine_restart_while_the_subscriber_runs(index, published_while_away):
    eng = engine()
    try:
        sub = subscribe(index, eng)
        for chain in chains(7, 30):
            eng.serve(chain)
        wait_applied(sub, "e", eng.publisher)
        old_last = eng.publisher.next_seq - 1
        eng.cache.clear()
        eng.publisher.restart(rebind=True)
        # The new engine's first batches go out before the SUB socket reconnects: to
        # nobody.  "exactly_next": the first one the subscriber sees is old_last + 1.
        target = old_last + (20 if published_while_away == "past" else 0)
        for chain in chains(8, 400):
            if eng.publisher.next_seq > target:
                break
            eng.serve(chain)
        time.sleep(0.5)  # the SUB socket reconnects
        for chain in chains(9, 5):
            eng.serve(chain)
        wait_applied(sub, "e", eng.publisher)
        assert sub.stats["e"].restarts == 1
        assert held(index, eng.holder) == set(eng.cache)
        sub.close()
    finally:
        eng.publisher.close()


def test_a_flood_replayed_while_it_is_applied_leaves_the_index_equal_to_the_engine(index):
    # 20,000 batches published as fast as the engine can, while serve is down; serve
    # starts and catches up from the engine's buffer.  Applying the backlog takes far
    # longer than the replay deadline (0.5 s per message here); the replay itself
    # streams in well within it.  Before, the deadline covered the whole replay, it
    # "timed out" part-way, and the rest of the backlog was never applied.
    eng = engine(capacity=3000)
    rng = random.Random(11)
    roots = [[rng.getrandbits(63) for _ in range(4)] for _ in range(50)]
    try:
        for _ in range(20_000):
            eng.serve(rng.choice(roots) + [rng.getrandbits(63) for _ in range(3)])
        assert eng.publisher.next_seq == 20_000
        sub = subscribe(index, eng, replay_idle_timeout_s=0.5)
        sub.catch_up()
        assert sub.last_seq["e"] == 19_999
        stats = sub.stats["e"]
        assert stats.unrecoverable_gaps == 0 and stats.restarts == 0
        assert stats.replayed == 20_000
        assert held(index, eng.holder) == set(eng.cache)
        sub.close()
    finally:
        eng.publisher.close()


def free_port_pair() -> int:
    """A base port P with P and P+1 free on loopback (bind-tested, then released)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            if base >= 65000:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
        return base
    raise RuntimeError("no two adjacent free ports on loopback")


def test_dp_ranks_from_one_source_spec(index):
    pub_base, replay_base = free_port_pair(), free_port_pair()
    ctx = zmq.Context.instance()
    ranks = []
    try:
        for r in range(2):
            pub = EnginePublisher(ctx, bind=(f"tcp://127.0.0.1:{pub_base + r}",
                                             f"tcp://127.0.0.1:{replay_base + r}"),
                                  replay_topic=True)
            ranks.append(SimEngine("e", 40, pub, dp_rank=r))
        spec = f"e=tcp://127.0.0.1:{pub_base},tcp://127.0.0.1:{replay_base}"
        sources = Source.expand(spec, dp_ranks=2)
        assert [s.key for s in sources] == ["e#0", "e#1"]
        sub = Subscriber(index, sources)
        time.sleep(0.2)
        for i, chain in enumerate(chains(12, 60)):
            ranks[i % 2].serve(chain, style="sglang")  # SGLang names its rank attn_dp_rank
        for r, rank in enumerate(ranks):
            # Each rank has its own sequence from 0 on its own port.
            wait_applied(sub, f"e#{r}", rank.publisher)
            assert held(index, f"e#{r}") == set(rank.cache) != set()
            assert sub.stats[f"e#{r}"].rank_mismatches == 0
        sub.close()
    finally:
        for rank in ranks:
            rank.publisher.close()


def test_source_expand_refuses_what_engines_cannot_bind():
    with pytest.raises(ValueError, match="one --source per rank"):
        Source.expand("e=ipc:///tmp/kv", dp_ranks=2)
    with pytest.raises(ValueError, match="DP size"):
        Source.expand("e=tcp://127.0.0.1:5557", dp_ranks=0)
    assert Source.expand("e=ipc:///tmp/kv", dp_ranks=1)[0].key == "e#0"


def test_sarp_serve_with_dp_ranks_outlives_every_bad_input(tmp_path):
    """The process end to end: `sarp serve --dp-ranks 2`, fed what stopped it before."""
    import signal
    import subprocess
    import sys

    import msgpack

    pub_base, replay_base = free_port_pair(), free_port_pair()
    ctx = zmq.Context.instance()
    pubs = [EnginePublisher(ctx, bind=(f"tcp://127.0.0.1:{pub_base + r}",
                                       f"tcp://127.0.0.1:{replay_base + r}")) for r in range(2)]
    cmd = [sys.executable, "-m", "sarp.cli", "serve", "--index", str(tmp_path / "ix"),
           "--durability", "nosync", "--dp-ranks", "2", "--source",
           f"eng=tcp://127.0.0.1:{pub_base},tcp://127.0.0.1:{replay_base}"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)

    def seqs() -> dict | None:
        return servekit.applied(tmp_path / "ix")

    try:
        deadline = time.monotonic() + 30
        while seqs() is None and time.monotonic() < deadline:  # caught up: state written
            time.sleep(0.05)
        time.sleep(0.5)
        for r, pub in enumerate(pubs):
            pub.publish(encode_batch([("stored", [1, 2, 3], None, "GPU")], dp_rank=r))
            pub.publish(msgpack.packb([1.0, [
                ["BlockStored", [777, 778, 777], None, [], 16, None, "GPU"],
                ["BlockStored", [2], None, [], 16, None, "GPU"],  # ChainConflictError
                ["BlockStored", [9], 3, [], 16, None, "GPU\x00"],
                ["BlockStored", [9], 3, [], 16, None, "x" * 1000],
                ["BlockStored", [60, 61], 61, [], 16, None, "GPU"],
                ["BlockStored", [4], 3, [], 16, None, "CPU_PINNED"],
            ], r]))
            pub.pub.send_multipart([b"", (-3).to_bytes(8, "big", signed=True), b"\x90"])
            pub.publish(encode_batch([("removed", [3], "GPU")], dp_rank=r, style="vllm-0.33"))
        deadline = time.monotonic() + 30
        while seqs() != {"eng#0": 2, "eng#1": 2} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seqs() == {"eng#0": 2, "eng#1": 2}
        assert proc.poll() is None  # still serving
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pub in pubs:
            pub.close()
    with sarp.open(tmp_path / "ix") as index:
        m = index.match([1, 2, 3, 4])
        # 1, 2 stored, 3 removed; the store of 2 as a root was refused (a chain conflict),
        # so the holder let go of 2 as well: a later store under 2 could not be placed
        # (tests/test_hardening.py, item 9)
        assert m.by_medium == {"eng#0": {"GPU": 1}, "eng#1": {"GPU": 1}}
        assert index.match([777]).num_blocks == index.match([60]).num_blocks == 0


def test_sigkill_of_serve_in_the_middle_of_batched_commits_then_catch_up(tmp_path):
    """serve is applying a backlog many batches per commit; SIGKILL; restart; equal."""
    import signal
    import subprocess
    import sys

    eng = engine(capacity=2000)

    def applied() -> int:
        return (servekit.applied(tmp_path / "ix") or {}).get("e", -1)

    def serve() -> subprocess.Popen:
        pub = eng.publisher
        return subprocess.Popen(
            [sys.executable, "-m", "sarp.cli", "serve", "--index", str(tmp_path / "ix"),
             "--durability", "nosync", "--replay-idle-timeout-s", "1",
             "--source", f"e={pub.endpoint},{pub.replay_endpoint}"],
            stderr=subprocess.DEVNULL)

    rng = random.Random(21)
    roots = [[rng.getrandbits(63) for _ in range(4)] for _ in range(40)]
    for _ in range(20_000):  # a backlog in the engine's buffer, before serve starts
        eng.serve(rng.choice(roots) + [rng.getrandbits(63) for _ in range(6)])
    last = eng.publisher.next_seq - 1
    proc = serve()
    try:
        deadline = time.monotonic() + 60
        while applied() < 0 and time.monotonic() < deadline:  # the first commit
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)  # mid-backlog: commits of many batches each
        proc.wait(timeout=10)
        killed_at = applied()
        assert 0 <= killed_at < last, (killed_at, last)
        # The state names exactly what the index holds: it was written in the same
        # transaction as the commit of the batches it names, never a commit apart.
        oracle = Applier(sarp.open(tmp_path / "oracle"))
        for _, payload in list(eng.publisher.buffer)[: killed_at + 1]:
            oracle.add("e", decode(payload), ApplyStats())
        oracle.flush()
        with sarp.open(tmp_path / "ix", readonly=True) as index:
            assert np.array_equal(index.blocks_of(eng.holder), oracle.index.blocks_of(eng.holder))
        oracle.index.close()
        for _ in range(200):  # the engine goes on meanwhile
            eng.serve(rng.choice(roots) + [rng.getrandbits(63) for _ in range(6)])
        proc = serve()
        last = eng.publisher.next_seq - 1
        deadline = time.monotonic() + 120
        while applied() < last and time.monotonic() < deadline:
            time.sleep(0.05)
        assert applied() == last
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        eng.publisher.close()
    with sarp.open(tmp_path / "ix") as index:
        assert set(index.blocks_of(eng.holder).tolist()) == set(eng.cache)
        assert index.check() == []


def test_one_new_engine_batch_taken_as_a_continuation_cannot_prove_itself(index):
    # The race left open by a reconnect noticed late: the new engine's batch N+1 arrives
    # first, is next in line, and is applied; then the reconnect is noticed and checked.
    # The proof covers the last two batches, so the new engine's N fails it.
    eng = engine()
    try:
        sub = subscribe(index, eng)
        for chain in chains(30, 30):
            eng.serve(chain)
        wait_applied(sub, "e", eng.publisher)
        old_last = eng.publisher.next_seq - 1
        eng.cache.clear()
        eng.publisher.restart()  # same sockets: nothing for the monitor to see
        requests = iter(chains(31, 400))
        while eng.publisher.next_seq <= old_last:
            eng.serve(next(requests), drop=True)  # the new engine's first batches: unseen
        eng.serve(next(requests))  # batch old_last + 1, live: next in line
        wait_applied(sub, "e", eng.publisher)
        assert sub.stats["e"].restarts == 0  # taken as a continuation, so far
        sub._verify.add("e")  # the reconnect, noticed now (as the socket monitor would)
        settle(sub)
        assert sub.stats["e"].restarts == 1
        assert held(index, eng.holder) == set(eng.cache)
        sub.close()
    finally:
        eng.publisher.close()


_ENGINE_PROCESS = """
import json, random, sys, time
import zmq
from sarp.bench.cluster import EnginePublisher, SimEngine
from sarp.serving import inline
pub, replay, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
eng = SimEngine("e", 200, EnginePublisher(zmq.Context.instance(), bind=(pub, replay)))
print("ready", flush=True)
sys.stdin.readline()  # the subscriber is connected
rng = random.Random(seed)
for _ in range(30):
    eng.serve([rng.getrandbits(63) for _ in range(5)])
print(json.dumps({"last": eng.publisher.next_seq - 1, "cache": list(eng.cache)}), flush=True)
time.sleep(600)  # idle, as an engine between requests: alive, answering replays
"""


def test_an_engine_killed_with_sigkill_is_taken_as_gone_and_its_blocks_forgotten(index):
    """An idle engine answers the liveness probe and keeps its blocks; a killed one does
    not, and its blocks leave the index; started again, it is followed again."""
    import json
    import signal
    import subprocess
    import sys

    base = free_port_pair()
    endpoints = (f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}")

    def start(seed: int) -> tuple[subprocess.Popen, dict]:
        proc = subprocess.Popen([sys.executable, "-c", _ENGINE_PROCESS, *endpoints, str(seed)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the SUB socket (re)connects
            sub.poll(20)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        return proc, json.loads(proc.stdout.readline())

    def poll_until(done, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            sub.poll(20)

    sub = Subscriber(index, [Source("e", *endpoints)], probe_after_s=0.3, dead_after_s=0.7)
    procs = []
    try:
        proc, engine_state = start(1)
        procs.append(proc)
        poll_until(lambda: sub.last_seq.get("e", -1) >= engine_state["last"], 10)
        poll_until(lambda: False, 2.0)  # idle: several probes, all answered
        stats = sub.stats["e"]
        assert stats.probes >= 3 and stats.gone == 0
        assert held(index, "e#0") == set(engine_state["cache"])

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        poll_until(lambda: not held(index, "e#0"), 10)
        assert held(index, "e#0") == set() and stats.gone == 1
        assert index.check() == []

        proc, engine_state = start(2)  # a new engine on the same ports
        procs.append(proc)
        poll_until(lambda: held(index, "e#0") == set(engine_state["cache"]), 10)
        assert held(index, "e#0") == set(engine_state["cache"])
        assert stats.gone == 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        sub.close()


def test_an_engine_that_publishes_while_asked_is_not_taken_as_gone(index, monkeypatch):
    """A probe goes out after a silence; the engine's replay endpoint never answers
    (a ROUTER nobody reads), but it publishes again before the probe times out: it is
    alive, and its blocks stay.  The subscriber's clock moves only when the test moves
    it, so no window depends on this machine's speed."""
    clock = subscriber_clock(monkeypatch, _Clock(0.0))
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind("tcp://127.0.0.1:*")
    router.bind("tcp://127.0.0.1:*")
    endpoints = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (pub, router)]
    sub = Subscriber(index, [Source("e", *endpoints)], probe_after_s=0.3, dead_after_s=1.5,
                     replay_idle_timeout_s=0.2)

    def poll_until(done, real_s: float = 30.0) -> None:
        deadline = time.monotonic() + real_s
        while not done() and time.monotonic() < deadline:
            sub.poll(10)
        assert done()

    def publish(seq: int, hashes: list[int], parent: int | None) -> None:
        payload = encode_batch([("stored", hashes, parent, "GPU")], ts=time.time(), dp_rank=0)
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # the SUB socket connects
            sub.poll(10)
        t0 = clock.now
        publish(0, [11, 12], None)
        poll_until(lambda: held(index, "e#0") == {11, 12})
        clock.now = t0 + 0.4  # silent past probe_after_s: a probe goes out, due at +1.9
        poll_until(lambda: sub.stats["e"].probes >= 1)
        clock.now = t0 + 0.9
        publish(1, [13], 12)  # heard from: the probe's verdict no longer counts
        poll_until(lambda: held(index, "e#0") == {11, 12, 13})
        clock.now = t0 + 2.25  # past the first probe's deadline only
        for _ in range(20):
            sub.poll(10)
        assert sub.stats["e"].gone == 0
        assert held(index, "e#0") == {11, 12, 13}
    finally:
        sub.close()
        pub.close(linger=0)
        router.close(linger=0)


def test_sources_with_a_backlog_are_drained_in_turns(index):
    # Two engines each queue 200 batches before serve polls: serve takes a few from one,
    # then a few from the other, so neither waits for the other's whole backlog (and
    # the index follows both in time order); every block still ends up as the engines
    # hold it.
    engines = [engine("a", capacity=200), engine("b", capacity=200)]
    rng = random.Random(5)
    try:
        sub = Subscriber(index, [Source(e.name, e.publisher.endpoint, e.publisher.replay_endpoint)
                                 for e in engines])
        time.sleep(0.3)  # both SUB sockets connected before anything is published
        for _ in range(200):
            for e in engines:
                e.serve([rng.getrandbits(63) for _ in range(4)])
        time.sleep(0.5)  # everything waits in the SUB sockets
        order: list[str] = []
        handle, taken = sub._on_message, sub.applier.taken

        one_by_one = []

        def record(key, frames):
            order.append(key)
            one_by_one.append(key)
            try:
                return handle(key, frames)
            finally:
                one_by_one.pop()

        def record_taken(stats, first, batches, *rest):  # (the C lane, the prefetch)
            if not one_by_one:
                order.extend([next(k for k, s in sub.stats.items() if s.applied is stats)]
                             * batches)
            return taken(stats, first, batches, *rest)

        sub._on_message, sub.applier.taken = record, record_taken
        deadline = time.monotonic() + 30
        while len(order) < 400 and time.monotonic() < deadline:
            sub.poll(100)
        longest = max(len(run) for run in "".join(order).replace("ab", "a b").replace(
            "ba", "b a").split())
        assert longest <= 16, f"{longest} messages in a row from one source"
        assert order.count("a") == order.count("b") == 200
        for e in engines:
            assert held(index, e.holder) == set(e.cache)
        sub.close()
    finally:
        for e in engines:
            e.publisher.close()


def test_serves_collector_setting_is_put_back():
    import gc

    from sarp.serving.serve import YOUNG_OBJECTS, collector_tuned

    before = gc.get_threshold()
    with collector_tuned():
        assert gc.get_threshold()[0] == YOUNG_OBJECTS and gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


class _Clock:
    """The subscriber's clock in a test: ``monotonic`` moves only when the test moves it
    or the subscriber sleeps (at once: ``on_sleep`` runs first, if set); ``time`` runs
    ``skew_s`` ahead of the real clock (how old batches look)."""

    def __init__(self, skew_s: float) -> None:
        self.now, self.skew_s = 1000.0, skew_s
        self.on_sleep = None

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time() + self.skew_s

    def sleep(self, seconds: float) -> None:
        if self.on_sleep is not None:
            self.on_sleep()
        self.now += seconds


def subscriber_clock(monkeypatch, clock: _Clock) -> _Clock:
    """``clock`` as the subscriber's, in both its modules: the replay jobs' and the
    liveness probes' times (``replay``) are compared with its own."""
    from sarp.serving import replay, subscriber

    for module in (subscriber, replay, inline):
        monkeypatch.setattr(module, "time", clock)
    return clock


def one_ms_a_message(sub: Subscriber, clock: _Clock) -> None:
    """Each message the subscriber reads takes 1 ms on ``clock``: those it takes one
    by one, and those the C lane takes several at a time (each 1 ms, the flush checked
    after them, as the lane's caller checks it).  No prefetch: its messages would take
    no time on ``clock``."""
    sub.prefetching = False
    handle, in_line = sub._on_message, sub._in_line

    def one_ms_each(key, frames):
        clock.now += 0.001
        return handle(key, frames)

    def one_ms_in_line(sock, key, count):
        got = in_line(sock, key, 1)  # one at a time, so each message's 1 ms is its own
        clock.now += 0.001 * got[1]
        return got

    sub._on_message, sub._in_line = one_ms_each, one_ms_in_line


def drain_backlog(index, monkeypatch, skew_s: float) -> tuple[list[int], list[int]]:
    """500 batches queued before the subscriber reads, each message taking 1 ms on
    its clock; then, caught up, 60 more. The batches per commit of each part."""
    from sarp.serving import subscriber as module

    clock = _Clock(skew_s)
    subscriber_clock(monkeypatch, clock)
    eng = engine("e", capacity=5000)
    commits: list[int] = []
    try:
        sub = subscribe(index, eng, on_commit=lambda fps: commits.append(len(fps)))
        one_ms_a_message(sub, clock)
        rng = random.Random(11)
        for _ in range(500):
            eng.serve([rng.getrandbits(63) for _ in range(3)])
        time.sleep(0.5)  # everything waits in the SUB socket
        while sub.last_seq.get("e", -1) < 499:
            sub.poll(100)
        backlog = list(commits)
        assert sum(backlog) == 500
        assert sub._batch_ms == module.MAX_BATCH_MS  # the socket ran dry
        assert held(index, eng.holder) == set(eng.cache)
        commits.clear()
        clock.skew_s = -1.0  # from now on batches are fresh
        for _ in range(60):
            eng.serve([rng.getrandbits(63) for _ in range(3)])
        time.sleep(0.3)
        while sub.last_seq.get("e", -1) < 559:
            sub.poll(100)
        assert held(index, eng.holder) == set(eng.cache)
        sub.close()
        return backlog, commits
    finally:
        eng.publisher.close()


def test_a_backlog_of_fresh_batches_is_committed_in_growing_batches(index, monkeypatch):
    # Batches that look fresh (the engine's clock behind ours), but the socket never
    # runs dry: the subscriber is behind all the same, so each commit may wait twice
    # as long as the last (20, 40, then 80 ms at most). Once the socket has run dry,
    # a commit waits 20 ms again.
    backlog, caught_up = drain_backlog(index, monkeypatch, skew_s=-1.0)
    assert [round(s, -1) for s in backlog[:5]] == [20, 40, 80, 80, 80], backlog
    assert round(caught_up[0], -1) == 20, caught_up


@pytest.fixture
def fresh_clock(monkeypatch) -> _Clock:
    """The subscriber's clock as the test's, its batches fresh (published just now)."""
    return subscriber_clock(monkeypatch, _Clock(skew_s=-1.0))


def publish(eng: SimEngine, rng: random.Random, batches: int = 1,
            settle_s: float = 0.05) -> None:
    """``batches`` batches of 3 new blocks, then time for them to reach the SUB socket."""
    for _ in range(batches):
        eng.serve([rng.getrandbits(63) for _ in range(3)])
    time.sleep(settle_s)


@pytest.mark.parametrize("wait_ms", [5.0, 0.0])
def test_batches_that_arrive_while_a_commit_waits_share_it(index, fresh_clock, wait_ms):
    # Engines publishing at a steady rate: the sockets run dry between batches. The
    # first batch queued waits commit_wait_ms for more (one commit costs LMDB about as
    # many page writes for a few events as for hundreds), and poll returns with all
    # of it committed; with 0 each batch is committed as soon as the sockets run dry.
    clock = fresh_clock
    eng = engine("e", capacity=500)
    commits: list[int] = []
    try:
        sub = subscribe(index, eng, commit_wait_ms=wait_ms,
                        on_commit=lambda fps: commits.append(len(fps)))
        rng = random.Random(3)
        publish(eng, rng)
        clock.on_sleep = lambda: publish(eng, rng)  # the next comes while the commit waits
        for _ in range(50):
            sub.poll(0)
            if sub.last_seq.get("e", -1) >= 0:
                break
        else:
            raise AssertionError("the first batch never arrived")
        clock.on_sleep = None
        if wait_ms:
            assert commits == [2] and sub.last_seq["e"] == 1, commits
        else:
            assert commits == [1] and sub.last_seq["e"] == 0, commits
        assert held(index, eng.holder) == set(eng.cache)  # all committed when poll returned
        sub.close()
    finally:
        eng.publisher.close()


@pytest.mark.parametrize("wait", [21, -1, float("nan"), "5", True])
def test_a_commit_wait_outside_its_range_is_refused(index, wait):
    with pytest.raises(ValueError, match=r"commit_wait_ms=.*from 0 to 20"):
        Subscriber(index, [], commit_wait_ms=wait)


def test_a_backlog_of_old_batches_is_committed_in_big_batches_from_the_first(
        index, monkeypatch):
    # Batches published more than BEHIND_S (1 s) ago, as after a restart: the first
    # commit already waits the longest (80 ms); caught up, with fresh batches, 20 ms
    # again.
    backlog, caught_up = drain_backlog(index, monkeypatch, skew_s=2.0)
    assert [round(s, -1) for s in backlog[:3]] == [80, 80, 80], backlog
    assert round(caught_up[0], -1) == 20, caught_up


def test_a_commit_carries_its_state_unless_an_operation_fails(where):
    """The subscriber's fingerprints join the commit of the batches they name, so a
    restart never finds them a commit apart from the index; a refused store leaves the
    state to the follow-up commit that lets its hashes go."""
    with sarp.open(where("ix"), durability="nosync") as index:
        r = index.apply_decoded([("insert", np.uint64([1, 2]), None, "e", "GPU")],
                                state={"s": b"1"})
        assert r.failed == [] and index.read_state("s") == b"1"
        r = index.apply_decoded([("insert", np.uint64([9]), 777, "e", "GPU")],
                                state={"s": b"2"})  # its parent is not held
        assert len(r.failed) == 1 and index.read_state("s") == b"1"
        applier = Applier(index)
        applier.add("e", decode(encode_batch([("stored", [9], 777, "GPU")])), ApplyStats())
        assert applier.flush({"s": b"3"}) and index.read_state("s") == b"3"
        assert not applier.flush({"s": b"4"})  # nothing queued: no commit took it
        assert index.read_state("s") == b"3"
        batches = index.stats()["batches"]
        index.apply_decoded([], state={"s": b"4"})  # the state alone: not a batch
        assert index.read_state("s") == b"4" and index.stats()["batches"] == batches
        index.write_state("s", b"5")
        assert index.read_state("s") == b"5" and index.match([1, 2]).by_holder == {"e": 2}


def test_hundreds_of_engines_are_followed_and_one_past_the_limit_is_refused_unchanged(index):
    """ZeroMQ's default of 1,023 sockets a context held about 250 engines, and the one
    after stopped serve; now 600 are followed, and when the process is out of
    descriptors, adding one more is an OSError that names the limit and changes
    nothing: the engines followed go on, and one can be added once room is made."""
    import resource

    ctx = zmq.Context()
    ports = iter(range(20_000, 40_000, 2))  # nothing listens there: connects retry quietly
    def source(i: int) -> Source:
        p = next(ports)
        return Source(f"e{i}", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{p + 1}")
    sub = Subscriber(index, [source(i) for i in range(600)], context=ctx, probe_after_s=None)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        assert len(sub.sources) == 600
        # this process's descriptors run out (none below 3 is free): the next engine's
        # sockets cannot open, the ones open go on
        resource.setrlimit(resource.RLIMIT_NOFILE, (3, limits[1]))
        with pytest.raises(OSError, match="open-files limit"):
            sub.add_source(source(600))
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        assert "e600" not in sub.sources and len(sub._subs) == 600
        sub.remove_source("e0")
        sub.add_source(source(601))
        assert "e601" in sub.sources and len(sub._subs) == len(sub._sub_of) == 600
        sub.poll(10)  # the polls go on over every socket
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        sub.close()
        ctx.destroy(linger=0)


def test_a_replay_that_finds_no_socket_fails_as_a_replay_does_and_is_retried(index):
    """Out of descriptors when an engine's replay is asked: not an error out of the
    poll (which stopped serve) but a failed replay, its holders cleared and the replay
    asked again after the backoff."""
    import resource

    eng = engine("r")
    ctx = zmq.Context()
    sub = Subscriber(index, [Source("r", eng.publisher.endpoint, eng.publisher.replay_endpoint)],
                     context=ctx, probe_after_s=None)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (3, limits[1]))
        try:
            sub.start_catch_up()  # the replay's DEALER cannot open
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        assert sub.stats["r"].failed_replays == 1 and "r" in sub._retry_at
        eng.serve([1, 2, 3])
        deadline = time.monotonic() + 10
        while held(index, eng.holder) != {1, 2, 3} and time.monotonic() < deadline:
            sub.poll(50)  # the retry, after its backoff, proves the engine
        assert held(index, eng.holder) == {1, 2, 3} and sub.stats["r"].failed_replays == 1
    finally:
        sub.close()
        ctx.destroy(linger=0)
        eng.publisher.close()


def test_a_poll_waits_for_a_commit_once_while_batches_keep_coming(index, fresh_clock):
    # Batches that never stop (each sleep brings more, each taking 1 ms to read): the
    # commit's wait happens once in a poll, which then commits and returns (a loop
    # that waited again after every mid-read commit kept serve's loop, its status
    # heartbeat and SIGTERM waiting for as long as the stream lasted).
    clock = fresh_clock
    eng = engine("e", capacity=5000)
    rng = random.Random(5)
    sleeps = []
    try:
        sub = subscribe(index, eng)
        one_ms_a_message(sub, clock)

        def more() -> None:
            sleeps.append(clock.now)
            assert len(sleeps) < 50, "the poll never returned"
            publish(eng, rng, 20, settle_s=0.1)

        publish(eng, rng, 23, settle_s=0.3)  # read in 23 ms: a commit at 20, 3 queued after
        clock.on_sleep = more
        sub.poll(100)
        clock.on_sleep = None
        assert len(sleeps) <= 1, sleeps
        sub.close()
    finally:
        eng.publisher.close()


def test_a_poll_that_stops_at_its_message_budget_commits_without_waiting(
        index, monkeypatch, fresh_clock):
    # More batches waiting than one poll reads: the sockets did not run dry, so the
    # commit does not wait for more (there are more; the next poll reads them).
    from sarp.serving import subscriber as module

    clock = fresh_clock
    monkeypatch.setattr(module, "POLL_MESSAGES", inline.ROUND_MESSAGES)
    eng = engine("e", capacity=5000)
    rng = random.Random(6)
    sleeps, commits = [], []
    try:
        sub = subscribe(index, eng, on_commit=lambda fps: commits.append(len(fps)))
        publish(eng, rng, 20, settle_s=0.3)
        clock.on_sleep = lambda: sleeps.append(clock.now)
        sub.poll(100)
        assert commits == [8] and not sleeps, (commits, sleeps)
        sub.poll(100)
        assert commits == [8, 8] and not sleeps, (commits, sleeps)
        sub.poll(100)  # the last 4: the sockets ran dry, so the commit waits once
        assert commits == [8, 8, 4] and len(sleeps) == 1, (commits, sleeps)
        sub.close()
    finally:
        eng.publisher.close()


def test_a_lone_batch_after_a_quiet_spell_is_committed_without_waiting(index, fresh_clock):
    # The wait gathers batches that come close together; one that comes more than the
    # wait after the last commit is likely alone, and is committed at once. The next,
    # close behind that commit, waits again.
    clock = fresh_clock
    eng = engine("e", capacity=500)
    rng = random.Random(7)
    sleeps, commits = [], []
    try:
        sub = subscribe(index, eng, commit_wait_ms=5,
                        on_commit=lambda fps: commits.append(len(fps)))
        clock.on_sleep = lambda: sleeps.append(clock.now)
        clock.now += 0.050  # quiet for 50 ms
        publish(eng, rng, settle_s=0.1)
        sub.poll(100)
        assert commits == [1] and sleeps == [], (commits, sleeps)
        assert held(index, eng.holder) == set(eng.cache)
        clock.now += 0.002  # 2 ms after that commit
        publish(eng, rng, settle_s=0.1)
        sub.poll(100)
        assert commits == [1, 1] and len(sleeps) == 1, (commits, sleeps)
        sub.close()
    finally:
        eng.publisher.close()


_BEGUN_WHEN_DROPPED = """
import json, sys, time
import zmq
import sarp
from sarp.bench.cluster import EnginePublisher, SimEngine
from sarp.serving import inline
from sarp.serving.subscriber import Source, Subscriber

index = sarp.open(sys.argv[1], durability="nosync")
eng = SimEngine("e", 200, EnginePublisher(zmq.Context.instance()))
pub = eng.publisher
sub = Subscriber(index, [Source("e", pub.endpoint, pub.replay_endpoint)])
time.sleep(0.2)
eng.serve([1, 2, 3])
while sub.last_seq.get("e", -1) < pub.next_seq - 1:
    sub.poll(5)
eng.serve([4, 5])  # in the SUB socket's queue, not read yet
time.sleep(0.2)
pub.close()  # the engine goes away
time.sleep(0.2)
sub.poll(0)  # the poll begins the waiting message, then the disconnect is handled
sub.poll(0)
eng = SimEngine("e", 200, EnginePublisher(zmq.Context.instance(),
                                          bind=(pub.endpoint, pub.replay_endpoint)))
pub = eng.publisher  # a new engine on the same ports
time.sleep(0.3)
eng.serve([7, 8])
deadline = time.monotonic() + 20
while time.monotonic() < deadline and 7 not in set(index.blocks_of("e#0").tolist()):
    sub.poll(20)
print(json.dumps({"held": sorted(index.blocks_of("e#0").tolist()),
                  "disconnects": sub.stats["e"].disconnects}), flush=True)
sub.close()
pub.close()
"""


def test_a_message_a_poll_began_when_its_engine_went_away_stops_nothing(tmp_path):
    """zmq_poll reads the first frame of a waiting message ahead; dropping the connection
    under it (serve reconnects on a disconnect) left libzmq expecting the rest from the
    new connection, and it aborts the process (``!_more``, fq.cpp).  Run in a child:
    the abort would take pytest with it."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _BEGUN_WHEN_DROPPED, str(tmp_path / "ix")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["disconnects"] >= 1
    assert {7, 8} <= set(got["held"]), got  # the new engine is followed


def test_the_state_a_commit_carries_names_every_fingerprint_field(tmp_path):
    """``subscriber.json`` as a commit writes it holds each source's fingerprint field
    for field (a field added to ``Fingerprint`` and not written fails here) and reads
    back as what was written."""
    import dataclasses
    import json

    from sarp.serving.sources import STATE_FILE, Fingerprint, fingerprints_state, load_fingerprints

    committed = {"e#0": Fingerprint(7, 2**64 - 1, 1.5, 3), "e#1": Fingerprint(0, None, 0.0)}
    data = fingerprints_state(committed)[STATE_FILE]
    assert json.loads(data)["sources"] == {k: dataclasses.asdict(fp)
                                           for k, fp in committed.items()}
    with sarp.open(tmp_path / "ix") as index:
        index.write_state(STATE_FILE, data)
        assert load_fingerprints(index) == committed
