"""The event path end to end over real ZeroMQ sockets on loopback: a simulated
cluster publishes vLLM-encoded events, some dropped on purpose; the subscriber
replays the gaps, follows engine restarts, and survives its own SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import servekit

import sarp
from sarp.bench.cluster import Cluster
from sarp.bench.traces import read_requests
from sarp.bench.workload import builtin
from sarp.serving.subscriber import Source, Subscriber


def synced(subscriber: Subscriber, cluster: Cluster, timeout_s: float = 5.0):
    """A sync callback: poll until every sent batch is applied (bounded in time)."""

    def sync() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            subscriber.poll(2)
            if all(subscriber.last_seq.get(e.name, -1) >= e.publisher.last_sent_seq
                   for e in cluster.engines):
                return

    return sync


def assert_index_equals_caches(index, cluster: Cluster) -> None:
    for engine in cluster.engines:
        held = set(index.blocks_of(engine.holder).tolist())
        assert held == set(engine.cache), (
            f"{engine.name}: index has {len(held - set(engine.cache))} blocks the engine "
            f"evicted and lacks {len(set(engine.cache) - held)} it holds"
        )
    assert index.check() == []


@pytest.fixture
def cluster():
    c = Cluster(engines=3, capacity_blocks=1500)
    yield c
    c.close()


def start(tmp_path, cluster):
    index = sarp.open(tmp_path / "ix", durability="nosync")
    subscriber = Subscriber(index, [Source.parse(s) for s in cluster.source_specs()])
    time.sleep(0.2)  # let the SUB sockets connect before the first publish
    return index, subscriber


@pytest.mark.traces
def test_dropped_events_are_replayed_and_the_index_equals_the_caches(tmp_path, cluster, mooncake):
    requests = [r.hashes for r in read_requests(mooncake, limit=1500)]
    index, subscriber = start(tmp_path, cluster)
    result = cluster.run(requests, "sarp", index=index, sync=synced(subscriber, cluster),
                         drop_rate=0.05, seed=3)
    subscriber.catch_up()  # a dropped last batch shows as a gap only when asked
    assert result.batches_dropped > 20
    summary = subscriber.summary()
    assert sum(s["gaps"] for s in summary.values()) > 10
    assert sum(s["replayed"] for s in summary.values()) >= result.batches_dropped
    assert sum(s["unrecoverable_gaps"] for s in summary.values()) == 0
    assert_index_equals_caches(index, cluster)
    subscriber.close()
    index.close()


def test_an_engine_restart_clears_its_holders(tmp_path, cluster):
    requests = [r.hashes for r in builtin(seed=9, chat_sessions=40, agent_sessions=1)]
    index, subscriber = start(tmp_path, cluster)
    sync = synced(subscriber, cluster)
    cluster.run(requests[:150], "round-robin", sync=sync)
    victim = cluster.engines[1]
    assert index.blocks_of(victim.holder).size
    victim.cache.clear()  # the engine restarts: empty cache, sequence back to 0
    victim.publisher.restart()
    cluster.run(requests[150:], "round-robin", sync=sync)
    assert subscriber.stats[victim.name].restarts == 1
    assert_index_equals_caches(index, cluster)
    subscriber.close()
    index.close()


def test_a_gap_the_replay_cannot_fill_never_leaves_removed_blocks_reported(tmp_path):
    cluster = Cluster(engines=2, capacity_blocks=300)
    for e in cluster.engines:
        e.publisher.buffer = type(e.publisher.buffer)(maxlen=2)  # a tiny replay buffer
    requests = [r.hashes for r in builtin(seed=10, chat_sessions=60, agent_sessions=0)]
    try:
        index, subscriber = start(tmp_path, cluster)
        sync = synced(subscriber, cluster, timeout_s=0.2)
        cluster.run(requests, "random", sync=sync, drop_rate=0.2, seed=1)
        subscriber.catch_up()
        assert sum(s.unrecoverable_gaps for s in subscriber.stats.values()) > 0
        for engine in cluster.engines:
            held = set(index.blocks_of(engine.holder).tolist())
            assert held <= set(engine.cache)  # knows less, never more
        subscriber.close()
        index.close()
    finally:
        cluster.close()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def serve(tmp_path, cluster) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sarp.cli", "serve", "--index", str(tmp_path / "ix"),
           "--durability", "nosync", "--snapshot-every-s", "0.5"]
    for spec in cluster.source_specs():
        cmd += ["--source", spec]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)


def served_up_to(tmp_path, cluster) -> bool:
    state = servekit.applied(tmp_path / "ix") or {}
    return all(state.get(e.name, -1) >= e.publisher.next_seq - 1 for e in cluster.engines)


def test_kill_9_of_the_subscriber_process_and_restart(tmp_path, cluster):
    requests = [r.hashes for r in builtin(seed=11, chat_sessions=80, agent_sessions=2)]
    third = len(requests) // 3
    proc = serve(tmp_path, cluster)
    try:
        wait_for(lambda: servekit.applied(tmp_path / "ix") is not None, 20,
                 "serve to start")
        time.sleep(0.3)
        cluster.run(requests[:third], "random", seed=4)
        wait_for(lambda: served_up_to(tmp_path, cluster), 30, "the first third applied")
        cluster.run(requests[third : 2 * third], "random", seed=5)
        os.kill(proc.pid, signal.SIGKILL)  # mid-stream: events keep coming meanwhile
        proc.wait(timeout=10)
        cluster.run(requests[2 * third :], "random", seed=6)
        proc = serve(tmp_path, cluster)
        wait_for(lambda: served_up_to(tmp_path, cluster), 60, "the restarted subscriber")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with sarp.open(tmp_path / "ix") as index:
        assert_index_equals_caches(index, cluster)
        assert index.stats()["recovered_from"] == "snapshot"


def test_source_specs_are_checked():
    with pytest.raises(ValueError, match="NAME=PUB_ENDPOINT"):
        Source.parse("tcp://127.0.0.1:5557")
    with pytest.raises(ValueError, match="no '#'"):
        Source.parse("w#1=tcp://127.0.0.1:5557")
    out = subprocess.run([sys.executable, "-m", "sarp.cli", "serve", "--index", "/tmp/x",
                          "--source", "bad"], capture_output=True, text=True)
    assert out.returncode == 2 and "NAME=PUB_ENDPOINT" in out.stderr


def test_blocks_of_lists_what_a_holder_holds(tmp_path):
    with sarp.open(tmp_path / "ix") as index:
        index.insert([1, 2, 3], holder="a", medium="GPU")
        index.insert([1, 2], holder="a", medium="CPU")
        index.insert([9], holder="b")
        assert index.blocks_of("a").tolist() == [1, 2, 3]
        assert index.blocks_of("a", medium="CPU").tolist() == [1, 2]
        assert index.blocks_of("nobody").dtype == np.uint64


def test_junk_on_the_wire_is_counted_and_the_stream_goes_on(tmp_path):
    import random

    from sarp.serving.events import encode_batch

    cluster = Cluster(engines=1, capacity_blocks=100, transport="ipc", ipc_dir=str(tmp_path))
    try:
        index, subscriber = start(tmp_path, cluster)
        engine = cluster.engines[0]
        rng = random.Random(5)
        engine.publisher.publish(encode_batch([("stored", [1, 2, 3], None, "GPU")], dp_rank=0))
        synced(subscriber, cluster)()
        assert index.match([1, 2, 3]).by_holder == {engine.holder: 3}
        for _ in range(50):
            engine.publisher.publish(bytes(rng.getrandbits(8) for _ in range(rng.randrange(40))))
        engine.publisher.pub.send_multipart([b"only-one-frame"])  # not (topic, seq, payload)
        engine.publisher.publish(encode_batch([("stored", [7, 8], None, "GPU")], dp_rank=0,
                                              style="vllm-0.33"))
        synced(subscriber, cluster)()
        stats = subscriber.stats[engine.name]
        assert stats.bad_payloads >= 40 and stats.bad_frames == 1
        # A batch that cannot be read may have removed blocks: the engine's blocks are
        # forgotten (the index knows less, never more) and the stream goes on.
        assert index.match([1, 2, 3]).num_blocks == 0
        assert index.match([7, 8]).by_holder == {engine.holder: 2}
        subscriber.close()
        index.close()
    finally:
        cluster.close()


def test_serve_on_a_folder_that_is_not_an_index_says_so_without_a_traceback(tmp_path):
    (tmp_path / "ix").mkdir()
    (tmp_path / "ix" / "junk").write_text("x")
    out = subprocess.run([sys.executable, "-m", "sarp.cli", "serve", "--index",
                          str(tmp_path / "ix"), "--source", "e=tcp://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "NotAnIndexError" in out.stderr
    assert "Traceback" not in out.stderr
