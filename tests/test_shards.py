"""An index sharded by engine over a real 3-node Valkey cluster on loopback: the model
test against the sharded index, shards spread over the nodes, a shard added while it
is read, and a shard's writer SIGKILLed and taken over by a standby while the other
shards' writers go on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from conftest import valkey_cluster, valkey_server
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule
from test_model import HOLDERS, NUM_NODES, SarpVsModel, model_match

import sarp

SHARD_OF = {"w0": "a", "w1": "b", "w2": "c"}  # each engine's blocks in one shard


class _Sharded:
    """The model test's index: writes go to the writer of the holder's shard, reads to
    :func:`sarp.open_shards` over all of them."""

    def __init__(self, url: str, segment_blocks: int) -> None:
        self.writers = {name: sarp.open(url, shard=name, segment_blocks=segment_blocks,
                                        durability="nosync", snapshot_every_changes=7)
                        for name in sorted(set(SHARD_OF.values()))}
        self.reader = sarp.open_shards(url)  # its shards are all there from the start

    def _of(self, holder: str) -> sarp.Index:
        return self.writers[SHARD_OF[holder]]

    def insert(self, hashes, parent=None, *, holder, medium, meta=None):
        return self._of(holder).insert(hashes, parent, holder=holder, medium=medium,
                                       meta=meta)

    def remove(self, hashes, *, holder, medium):
        return self._of(holder).remove(hashes, holder=holder, medium=medium)

    def clear(self, holder, medium=None):
        return self._of(holder).clear(holder, medium)

    def match(self, hashes, **kw):
        return self.reader.match(hashes, **kw)

    def match_many(self, chains, **kw):
        return self.reader.match_many(chains, **kw)

    def snapshot(self):
        for w in self.writers.values():
            w.snapshot()

    def check(self):
        return [p for w in self.writers.values() for p in w.check()]

    def close(self):
        self.reader.close()
        for w in self.writers.values():
            w.close()


class ShardedVsModel(SarpVsModel):
    """The whole model test on three shards of a 3-node cluster: every engine's answer
    is the model's (the unsharded index's), and the total is the longest prefix one
    shard's engines hold."""

    def open_index(self):
        if not hasattr(self, "url"):
            self.url = valkey_cluster().url(f"sh-{uuid.uuid4().hex[:10]}")
        return _Sharded(self.url, self.segment_blocks)

    def drop_snapshot(self) -> None:
        import valkey

        for location in sarp.store.shard_locations(self.url).values():
            ns = location.rsplit("/", 1)[1]
            with valkey.ValkeyCluster(host="127.0.0.1", port=valkey_cluster().servers[0].port) as c:
                c.delete(f"sarp:{{{ns}}}:snap")

    def shard_held(self, shard: str) -> dict:
        return {h: b for h, b in self.held.items() if SHARD_OF[h[0]] == shard}

    @rule(node=st.integers(0, NUM_NODES - 1), holder=st.sampled_from(HOLDERS),
          cut=st.integers(0, 30), data=st.data())
    def insert(self, node, holder, cut, data):
        # an engine's parent is a block of its own: refused when its shard has it not
        path = self.paths[node]
        start = min(cut, len(path) - 1)
        held = set().union(*self.shard_held(SHARD_OF[holder[0]]).values())
        parent = path[start - 1] if start else None
        if parent is not None and parent not in held:
            with pytest.raises(sarp.ParentNotFoundError):
                self.index.insert(path[start:], parent=parent, holder=holder[0],
                                  medium=holder[1])
            return
        meta = [h % 1000 for h in path[start:]] if data.draw(st.booleans()) else None
        self.index.insert(path[start:], parent=parent, holder=holder[0], medium=holder[1],
                          meta=meta)
        self.held[holder].update(path[start:])

    def expected_total(self, query, n: int) -> int:
        """The longest prefix one shard's engines hold (the unsharded ``n`` whenever
        engines hold prefixes)."""
        return max(model_match(self.shard_held(s), query)[0] for s in self.index.writers)


ShardedVsModel.TestCase.settings = settings(
    max_examples=8, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestShardedVsModel = ShardedVsModel.TestCase


def test_engine_like_chains_answer_as_one_unsharded_index():
    """Engines that hold prefixes (as their caches do): every answer, the total too,
    equals one unsharded index's fed the same stream."""
    rng = np.random.default_rng(7)
    url = valkey_cluster().url(f"eq-{uuid.uuid4().hex[:10]}")
    chains = [rng.integers(1, 2**63, 40, dtype=np.uint64) for _ in range(6)]
    with sarp.open(valkey_server().url(f"one-{uuid.uuid4().hex[:10]}"),
                   durability="nosync") as whole:
        writers = {s: sarp.open(url, shard=s, durability="nosync") for s in "abc"}
        try:
            for step in range(60):
                engine = f"e{step % 6}"
                chain = chains[int(rng.integers(0, 6))]
                shard = "abc"[step % 6 % 3]
                n = int(rng.integers(1, 40))
                for index in (whole, writers[shard]):
                    index.insert(chain[:n], holder=engine)
                if step % 4 == 3:  # evict a tail, as engines evict leaves first
                    k = int(rng.integers(1, n + 1))
                    for index in (whole, writers[shard]):
                        index.remove(chain[k:n][::-1], holder=engine)
            queries = [np.append(c[: int(rng.integers(1, 41))], np.uint64(12345))
                       for c in chains for _ in range(3)]
            with sarp.open_shards(url) as sharded:
                got = sharded.match_many(queries, with_presence=True)
                for q, g in zip(queries, got, strict=True):
                    want = whole.match(q, with_presence=True)
                    assert (g.num_blocks, g.by_holder, g.by_medium) == (
                        want.num_blocks, want.by_holder, want.by_medium)
                    assert g.presence.keys() == want.presence.keys()
                    for key, row in want.presence.items():
                        assert np.array_equal(g.presence[key], row)
        finally:
            for w in writers.values():
                w.close()


def test_three_shards_spread_over_the_three_nodes_and_a_new_one_is_read():
    import valkey

    cluster = valkey_cluster()
    url = cluster.url(f"sp-{uuid.uuid4().hex[:10]}")
    with sarp.open(url, shard="a") as a, sarp.open(url, shard="b") as b, \
            sarp.open(url, shard="c") as c:
        for i, w in enumerate((a, b, c)):
            w.insert([1, 2, 3 + i], holder=f"w{i}")
        locations = sarp.store.shard_locations(url)
        client = valkey.ValkeyCluster(host="127.0.0.1", port=cluster.servers[0].port)
        nodes = {client.get_node_from_key(f"sarp:{{{loc.rsplit('/', 1)[1]}}}:meta").name
                 for loc in locations.values()}
        client.close()
        assert len(nodes) == 3, locations
        with sarp.open_shards(url, refresh_s=0) as reader:
            assert reader.match([1, 2, 3]).by_holder == {"w0": 3, "w1": 2, "w2": 2}
            with sarp.open(url, shard="d") as d:  # added while it is read
                d.insert([1, 2, 3], holder="w3")
                assert reader.shards == ["a", "b", "c"]  # not looked for yet ...
                assert reader.match([1, 2, 3]).by_holder["w3"] == 3  # ... now it is
                assert reader.shards == ["a", "b", "c", "d"]
    with sarp.open(url, shard="b") as again:  # a shard's name keeps its namespace
        assert str(again.path) == locations["b"]


def test_shard_mistakes_get_a_clear_error(tmp_path):
    url = valkey_server().url(f"bad-{uuid.uuid4().hex[:10]}")
    with pytest.raises(ValueError, match="shards are namespaces"):
        sarp.open(tmp_path / "ix", shard="a")
    with pytest.raises(ValueError, match="shards are namespaces"):
        sarp.open_shards(tmp_path)
    with pytest.raises(ValueError, match=r"shard='a b'.*\[A-Za-z0-9_-\]"):
        sarp.open(url, shard="a b")
    with pytest.raises(sarp.NotAnIndexError, match="no shard 'z'"):
        sarp.open(url, shard="z", readonly=True)
    with pytest.raises(ValueError, match="refresh_s"):
        sarp.open_shards(url, refresh_s=-1)
    with sarp.open_shards(url) as empty:  # nothing registered yet: nothing held
        assert empty.shards == [] and empty.match([1, 2]).num_blocks == 0
    # a shard registered by a writer that died before it made its index: skipped
    # until that index is there
    sarp.store.shard_location(url, "early")
    with sarp.open_shards(url, refresh_s=0) as reader:
        assert reader.shards == []
        with sarp.open(url, shard="early") as writer:
            writer.insert([1, 2], holder="w0")
            assert reader.match([1, 2]).by_holder == {"w0": 2}
            assert reader.shards == ["early"]


_SHARD_WRITER = """
import json, sys, time, numpy as np, sarp
url, shard, wait, first = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
index = sarp.open(url, shard=shard, durability="sync", lease_s=1.0, wait_for_lease_s=wait)
print(json.dumps({"open": True}), flush=True)
for i in range(first, first + 100000):
    index.insert(np.array([10**6 * i + k for k in range(1, 9)], np.uint64),
                 holder=f"{shard}-engine")
    print(json.dumps({"acked": i}), flush=True)  # insert returned: acknowledged
    time.sleep(0.002)
"""


def test_a_killed_shard_writer_is_taken_over_with_nothing_acknowledged_lost():
    url = valkey_cluster().url(f"ko-{uuid.uuid4().hex[:10]}")

    def writer(shard: str, wait: float = 0.0, first: int = 1) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", _SHARD_WRITER, url, shard, str(wait),
                              str(first)],
                             stdout=subprocess.PIPE, text=True)
        assert json.loads(p.stdout.readline()) == {"open": True}
        return p

    def acked(p: subprocess.Popen, at_least: int) -> int:
        last = 0
        while last < at_least:
            last = json.loads(p.stdout.readline())["acked"]
        return last

    procs = {s: writer(s) for s in "abc"}
    standby = None
    try:
        for p in procs.values():
            acked(p, 5)
        last_b = acked(procs["b"], 20)
        procs["b"].send_signal(signal.SIGKILL)
        procs["b"].wait(timeout=10)
        started = time.monotonic()
        # takes the lease once the dead one's runs out; writes chains of its own
        standby = writer("b", wait=30.0, first=200_000)
        took_over_s = time.monotonic() - started
        acked(standby, 200_003)
        others = {s: acked(procs[s], 40) for s in "ac"}  # they went on meanwhile
        with sarp.open_shards(url) as reader:
            for i in range(1, last_b + 1):  # every insert b acknowledged before dying
                chain = np.array([10**6 * i + k for k in range(1, 9)], np.uint64)
                assert reader.match(chain).by_holder.get("b-engine") == 8, i
            for s, n in others.items():
                chain = np.array([10**6 * n + k for k in range(1, 9)], np.uint64)
                assert reader.match(chain).by_holder.get(f"{s}-engine") == 8
        assert took_over_s < 20
    finally:
        for p in [*procs.values(), standby]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_two_shard_serves_each_follow_their_engine_and_answer_from_both(tmp_path):
    """``sarp serve --shard``: each serve writes its engines' shard, and its HTTP
    workers answer from every shard."""
    import random

    import servekit
    import zmq

    from sarp.bench.cluster import EnginePublisher, SimEngine

    url = valkey_cluster().url(f"sv-{uuid.uuid4().hex[:10]}")
    ctx = zmq.Context.instance()
    engines = [SimEngine(f"e{i}", 500, EnginePublisher(ctx, buffer_batches=10_000))
               for i in range(2)]
    ports = [servekit.free_port() for _ in engines]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "sarp.cli", "serve", "--index", url, "--shard", f"s{i}",
         "--durability", "nosync", "--http", f"127.0.0.1:{ports[i]}", "--http-workers", "1",
         "--source", f"{e.name}={e.publisher.endpoint},{e.publisher.replay_endpoint}"],
        stderr=subprocess.DEVNULL) for i, e in enumerate(engines)]
    rng = random.Random(3)
    try:
        for port in ports:
            servekit.wait_until(lambda p=port: servekit.call(p, "GET", "/healthz")[0] == 200,
                                60, lambda: "serve did not answer /healthz")
        time.sleep(0.5)  # subscribed before the engines publish
        chains = {e.name: [rng.getrandbits(63) for _ in range(12)] for e in engines}
        for e in engines:
            e.serve(chains[e.name])

        def both_seen() -> bool:
            _, got = servekit.match(ports[0], {"requests": [chains[e.name] for e in engines]})
            return [[(i["engine"], i["matched_blocks"]) for i in answer["instances"]]
                    for answer in got["results"]] == [[(e.name, 12)] for e in engines]
        servekit.wait_until(both_seen, 60, lambda: servekit.match(ports[0], {
            "block_hashes": chains["e1"]}))
        locations = sarp.store.shard_locations(url)
        assert sorted(locations) == ["s0", "s1"]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for e in engines:
            e.publisher.close()


def test_a_read_sent_ahead_is_taken_by_its_match_and_read_past_by_any_other(tmp_path):
    """``read_ahead`` sends a reader's next read; its match takes the reply (answering
    as of the read), any other read on the connection reads past it first, and when
    the connection breaks with a reply unread the match asks again: every answer is the
    index's at some moment from the call on, never another read's."""
    from sarp.bench.valkey_server import ValkeyServer

    folder = tmp_path / "valkey"
    server = ValkeyServer(aof=True, folder=folder)
    port, url = server.port, server.url("ahead")
    chain, other = np.arange(1, 41, dtype=np.uint64), np.arange(100, 130, dtype=np.uint64)
    try:
        with sarp.open(url, durability="sync") as writer, \
                sarp.open(url, readonly=True) as reader:
            writer.insert(chain, holder="a")
            writer.insert(other, holder="b")
            reader.read_ahead(chain)
            assert reader.match(other).by_holder == {"b": 30}  # read past chain's reply
            assert reader.match(chain).by_holder == {"a": 40}
            reader.read_ahead(chain)
            writer.remove(chain[20:][::-1], holder="a")
            assert reader.match(chain).by_holder == {"a": 40}  # as of the read it sent
            assert reader.match(chain).by_holder == {"a": 20}  # and now
            reader.read_ahead(other)
            assert reader.match_many([other, chain]) == [reader.match(other),
                                                          reader.match(chain)]
            reader.read_ahead(chain)
            writer.close()
            server.stop()  # the reply to the read sent ahead never comes
            server = ValkeyServer(aof=True, folder=folder, port=port)
            assert reader.match(chain).by_holder == {"a": 20}
    finally:
        server.stop()


def test_a_writer_reads_nothing_ahead(tmp_path):
    """Only a reader of a remote store sends anything ahead: on a writer (of LMDB or
    of Valkey) ``read_ahead`` does nothing and the matches are as before."""
    chain = np.arange(1, 9, dtype=np.uint64)
    with sarp.open(tmp_path / "i") as writer:
        writer.insert(chain, holder="a")
        writer.read_ahead(chain)
        assert writer.match(chain).by_holder == {"a": 8}
    with sarp.open(valkey_server().url(f"w-{uuid.uuid4().hex[:8]}")) as writer:
        writer.insert(chain, holder="a")
        writer.read_ahead(chain)
        assert writer._store._ahead.pending is None
        assert writer.match(chain).by_holder == {"a": 8}


def test_a_dropped_namespace_is_gone_on_its_node_and_the_others_are_not():
    """``drop_namespace`` (benchmarks' passes) deletes the keys of one index on the
    cluster node that holds its slot, and nothing of another namespace."""
    from sarp.valkey_shards import drop_namespace

    cluster = valkey_cluster()
    gone, kept = (cluster.url(f"{w}-{uuid.uuid4().hex[:8]}") for w in ("gone", "kept"))
    for url in (gone, kept):
        with sarp.open(url, durability="nosync") as index:
            index.insert(np.arange(1, 5, dtype=np.uint64), holder="a")
    assert drop_namespace(gone) >= 3  # meta, seg, blk, ... all of them
    with pytest.raises(sarp.NotAnIndexError):
        sarp.open(gone, readonly=True)
    with sarp.open(kept, readonly=True) as index:
        assert index.match(np.arange(1, 5, dtype=np.uint64)).by_holder == {"a": 4}
    assert drop_namespace(gone) == 0


def test_merge_takes_the_one_shard_that_holds_a_prefix_and_combines_several():
    from sarp.shards import merge
    from sarp.verify import Match

    held = Match(3, {"a": 3}, {"a": {"GPU": 3}}, storage_reads=2,
                 presence={("a", "GPU"): np.ones(3, bool)})
    one = merge([Match(0, storage_reads=1), held, Match(0, multi_medium=True)])
    assert (one.num_blocks, one.by_holder, one.storage_reads, one.multi_medium) == \
        (3, {"a": 3}, 3, True)
    assert one.presence[("a", "GPU")].tolist() == [True] * 3
    assert merge([Match(0), Match(0, storage_reads=4)]) == Match(0, storage_reads=4)
    both = merge([held, Match(2, {"b": 2}, {"b": {"CPU": 2}}, storage_reads=1,
                              presence={("b", "CPU"): np.ones(2, bool)})])
    assert (both.num_blocks, both.by_holder, both.storage_reads) == (3, {"a": 3, "b": 2}, 3)
    assert both.presence[("b", "CPU")].tolist() == [True, True, False]
    # each engine in one shard (the common case, merged by dict unions)
    plain = [Match(3, {"a": 3}, {"a": {"GPU": 3}}, storage_reads=2), Match(0, storage_reads=1),
             Match(2, {"b": 2, "c": 1}, {"b": {"CPU": 2}, "c": {"GPU": 1}}, storage_reads=1)]
    assert merge(plain) == Match(3, {"a": 3, "b": 2, "c": 1},
                                 {"a": {"GPU": 3}, "b": {"CPU": 2}, "c": {"GPU": 1}},
                                 storage_reads=4)
    # an engine two shards name (it moved between them): the longer prefix, per medium
    moved = merge([Match(3, {"a": 1, "b": 3}, {"a": {"GPU": 1}, "b": {"GPU": 3}}),
                   Match(2, {"a": 2}, {"a": {"CPU": 2}})])
    assert moved.by_holder == {"a": 2, "b": 3}
    assert moved.by_medium == {"a": {"GPU": 1, "CPU": 2}, "b": {"GPU": 3}}
