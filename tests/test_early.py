"""serve's first milliseconds (serving/early.py, serving/first.py): the command line
imports no numpy;
the first answers' child answers ``/query`` from the index on disk byte for byte as
the workers do, 503 for the rest and once the writer commits, and leaves when told
or when serve is gone; the engines' sockets connected before serve's imports are
adopted by its subscriber; a restart after kill -9 never answers wrong; the zygote
keeps no copy of the engines' connections.  Real processes and sockets, loopback."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servekit import Serve, applied, free_port, wait_until
from test_subscriber import chains, engine

import sarp
from sarp import native
from sarp.serving import early, first
from sarp.serving.events import _tokens_of

pytestmark = pytest.mark.skipif(native.C is None, reason="the first answers need sarp._native")

HELPER = """
import json, sys
from sarp.serving import early, first
made = early.start(sys.argv[1:])
print(json.dumps({"pid": made.answers.pid if made and made.answers else None,
                  "engines": sorted(made.engines) if made else []}), flush=True)
sys.stdin.readline()
made.close()
print("closed", flush=True)
"""


def raw(port: int, method: str, path: str, body: bytes | None = None,
        headers: dict | None = None) -> tuple[int, dict, bytes]:
    """Status, headers and the body's bytes as sent."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def query(tokens: list[int], model: str = "llama") -> bytes:
    return json.dumps({"token_ids": tokens, "model_name": model}).encode()


def snapshot_covers_the_store(ix: Path) -> bool:
    """Does the snapshot's watermark equal the store's next sequence?"""
    from sarp.store_lmdb import LmdbStore

    with open(ix / "directory.snap", "rb") as f:
        watermark = first._HEADER.unpack(f.read(first._HEADER.size))[4]
    store = LmdbStore(ix, readonly=True)
    try:
        return watermark == store.counter("next_seq")
    finally:
        store.close()


@pytest.fixture
def served(tmp_path):
    """An index a serve with HTTP left, SIGKILLed while its log ran past its last
    snapshot (more work applied after the snapshot); an engine of model llama; and
    the workers' answers to queries on both the work the snapshot holds and the work
    only the log after it holds."""
    eng = engine("7")
    work, more = chains(21, 6), chains(22, 4)
    ix = tmp_path / "ix"
    spec = f"7={eng.publisher.endpoint},{eng.publisher.replay_endpoint}"
    asked = [query(_tokens_of(c) + [5, 6]) for c in work + more]
    asked.append(query(_tokens_of(work[0][:4])))
    try:
        for chain in work:
            eng.serve(chain)
        with Serve(ix, [spec], "--model-name", "llama", "--block-size", "16") as serve:
            serve.wait_ready()

            serve.wait_for(lambda: all(b'"7"' in raw(serve.port, "POST", "/query",
                                                     query(_tokens_of(c)))[2] for c in work),
                           what="the engine's blocks")
            # serve writes a snapshot at an idle poll once the last is 2 s old
            serve.wait_for(lambda: snapshot_covers_the_store(ix), timeout_s=20,
                           what="a snapshot of the store's state")
            for chain in more:  # then more work, only in the log when serve is killed
                eng.serve(chain)
            last = eng.publisher.next_seq - 1  # (its evictions too: all of it applied)
            serve.wait_for(lambda: max((applied(ix) or {0: -1}).values()) >= last,
                           what="the engine's later batches")
            before = {q: raw(serve.port, "POST", "/query", q)[2] for q in asked}
            serve.proc.kill()
            serve.proc.wait(10)
        assert not snapshot_covers_the_store(ix)  # (the log runs past the snapshot)
        yield ix, eng, spec, before
    finally:
        eng.publisher.close()


def writer(call: str, ix: Path) -> None:
    """``call`` on the index at ``ix`` opened as its writer, in a process that then
    exits as if killed (no snapshot, no log trimmed at a close)."""
    subprocess.run([sys.executable, "-c", f"import os, sys, sarp; ix = sarp.open(sys.argv[1]);"
                    f" {call}; os._exit(0)", str(ix)], check=True, timeout=60)


def helper(args: list[str]) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", HELPER, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_the_command_line_and_the_first_answers_import_neither_numpy_nor_zmq():
    got = subprocess.run([sys.executable, "-c", "import sys, sarp.cli, sarp.serving.early; "
                          "print(sorted({'numpy', 'zmq', 'lmdb'} & set(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    assert got.strip() == "[]"


def test_what_the_first_answers_copy_is_what_they_mirror(tmp_path):
    from sarp import directory, snapshot, store
    from sarp.hashing import checksum
    from sarp.serving import rfc
    from sarp.tokenkeys import DEFAULT_TENANT, SEED, model_root

    assert (first.SEED, first.DEFAULT_TENANT) == (SEED, DEFAULT_TENANT)
    assert first.MAX_QUERY_BLOCKS == rfc.MAX_QUERY_BLOCKS
    assert first.SNAPSHOT_FILE == snapshot.SNAPSHOT_FILE
    assert first.HOT_ENTRIES == directory.HOT_ENTRIES
    assert first._LOG.format == store.LOG_VALUE.format
    assert first._HEADER.format == snapshot._HEADER.format
    rng = random.Random(3)
    with native.Tally() as tally:
        for n in (0, 1, 7, 64, 1000):
            data = rng.randbytes(n)
            seed = rng.getrandbits(64)
            assert native.C.xxh3_64(data) == checksum(data)
            assert native.C.xxh3_64(memoryview(data), seed) == checksum(data, seed)
    assert tally.c("xxh3_64") == 10
    engines = [{"name": "7", "dp_rank": 1, "model": "m", "tenant": "t", "block_size": 16},
               {"name": "8", "model": "m", "tenant": "t", "block_size": 16},
               {"name": "9", "model": None, "block_size": None}]
    mirrored = rfc.models_of(engines)
    (tmp_path / "serve-status.json").write_text(json.dumps({"engines": engines}))
    ours = first.models_of(tmp_path)
    assert ours.keys() == mirrored.keys() == {("m", "t")}
    assert (ours["m", "t"].block_size, ours["m", "t"].root, ours["m", "t"].ranks) == (
        16, model_root("m", "t"), mirrored["m", "t"].ranks)


def test_the_first_answers_are_the_workers_and_follow_the_writer(served):
    """From the snapshot and the log after it, byte for byte the workers' answers;
    caught up again at each query after a writer's commit."""
    ix, _, _, before = served
    port = free_port()
    proc, made = helper(["--index", str(ix), "--http", f"127.0.0.1:{port}"])
    try:
        assert made["pid"] is not None
        for q, answer in before.items():  # byte for byte the workers' answers
            assert raw(port, "POST", "/query", q)[:3:2] == (200, answer)
        status, head, body = raw(port, "GET", "/healthz")
        assert (status, json.loads(body)) == (200, {"status": "alive", "pid": made["pid"]})
        status, _, body = raw(port, "GET", "/readyz")  # readiness is the workers'
        assert status == 503 and json.loads(body)["ready"] is False
        assert [w["instance_id"] for w in json.loads(raw(port, "GET", "/workers")[2])] == [7]
        for refused in [("POST", "/v1/match", b'{"hashes": [1]}'), ("GET", "/metrics", None),
                        ("POST", "/query", query([1] * 40, "qwen")),  # a model not listed
                        ("POST", "/query", b"not json")]:
            status, head, body = raw(port, *refused)
            assert (status, head["Retry-After"], json.loads(body)["field"]) == (
                503, "1", "service"), refused
        # a writer clears the engine (and is killed: no snapshot): the next answers are
        # caught up with it, from the log
        writer("ix.clear('7#0')", ix)
        for q in before:
            status, _, body = raw(port, "POST", "/query", q)
            assert status == 200 and json.loads(body)["scores"] == {}, body
        # a snapshot that trims the log past the child's: it answers no more
        with sarp.open(ix, durability="nosync") as index:
            index.insert([15, 16], holder="w9")
        assert {raw(port, "POST", "/query", q)[0] for q in before} == {503}
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "closed"
        proc.wait(10)
    wait_until(lambda: gone(made["pid"]), 5, lambda: "the child did not leave when told")


def test_the_first_answers_ask_for_the_token_and_leave_when_serve_is_gone(served, tmp_path):
    ix, _, _, before = served
    (tmp_path / "token").write_text("s3cret\n")
    port = free_port()
    proc, made = helper(["--index", str(ix), "--http", f"127.0.0.1:{port}",
                         "--http-token-file", str(tmp_path / "token")])
    q, answer = next(iter(before.items()))
    assert raw(port, "POST", "/query", q)[0] == 401
    assert raw(port, "GET", "/workers")[0] == 401
    assert raw(port, "POST", "/query", q, {"Authorization": "Bearer s3cret"})[::2] == (
        200, answer)
    assert raw(port, "GET", "/healthz")[0] == 200  # probes ask for none
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    wait_until(lambda: gone(made["pid"]), 5, lambda: "the child outlived serve")


def test_no_answers_without_a_snapshot_the_log_still_reaches(served):
    ix, _, _, before = served
    stale = (ix / "directory.snap").read_bytes()
    with sarp.open(ix, durability="nosync") as index:  # a snapshot, and the log trimmed
        index.insert([13, 14], holder="w9")
    (ix / "directory.snap").write_bytes(stale)  # the older snapshot back
    port = free_port()
    proc, made = helper(["--index", str(ix), "--http", f"127.0.0.1:{port}"])
    try:  # it loaded, found the log trimmed past the snapshot, and left, accepting nothing
        wait_until(lambda: gone(made["pid"]), 5, lambda: "the child stayed")
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(10)
    # a damaged snapshot (the log reaching it again): refused at its checksum
    with sarp.open(ix, durability="nosync") as index:
        index.insert([19, 20], holder="w9")  # (closing writes a snapshot the log reaches)
    damaged = bytearray((ix / "directory.snap").read_bytes())
    damaged[70] ^= 1  # a directory key's byte
    (ix / "directory.snap").write_bytes(bytes(damaged))
    with pytest.raises(first.Unusable, match="checksum"):
        first.Loaded(ix)
    (ix / "directory.snap").unlink()
    proc, made = helper(["--index", str(ix), "--http", f"127.0.0.1:{port}"])
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(10)
    assert made["pid"] is None  # no snapshot: no child


def test_a_subscriber_adopts_the_sockets_connected_early_and_closes_the_rest(tmp_path):
    from sarp.bench.cluster import SimEngine
    from sarp.bench.conformance import Publisher
    from sarp.serving.sources import Source
    from sarp.serving.subscriber import Subscriber

    ctx = early.zmq_context()
    eng = SimEngine("e", 60, Publisher(ctx))  # (an XPUB: it tells when a subscriber came)
    try:
        pair = early.sub_socket(ctx, eng.publisher.endpoint, 1 << 20)
        stray = early.sub_socket(ctx, "tcp://127.0.0.1:9", 1 << 20)
        eng.publisher.wait_subscribers(1)
        work = chains(5, 3)
        for chain in work:  # published before the subscriber exists: queued in the socket
            eng.serve(chain)
        with sarp.open(tmp_path / "ix", durability="nosync") as index:
            sub = Subscriber(index, [Source("e", eng.publisher.endpoint,
                                            eng.publisher.replay_endpoint)],
                             max_frame_bytes=1 << 20,
                             adopt={eng.publisher.endpoint: pair, "tcp://127.0.0.1:9": stray})
            try:
                assert sub._sub_of["e"] is pair[0] and stray[0].closed and stray[1].closed
                deadline = time.monotonic() + 20
                while sub.last_seq.get("e", -1) < eng.publisher.next_seq - 1:
                    assert time.monotonic() < deadline, sub.last_seq
                    sub.poll(10)
                assert sub.stats["e"].replayed == 0  # from the socket, not the engine's buffer
                assert index.match(work[0]).num_blocks == len(work[0])
            finally:
                sub.close()
    finally:
        eng.publisher.close()


def _tcp_peers(pid: int) -> set[int]:
    """Remote ports of the TCP connections process ``pid`` holds descriptors of."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                ports.add(int(cols[2].rsplit(":", 1)[1], 16))
    return ports


def test_a_restart_after_kill_9_answers_right_or_503_and_its_zygote_holds_no_engine(served):
    """serve restarted on the index a SIGKILLed serve left: from its first answer on,
    every /query is the answer before the kill or a 503; the engine is followed again;
    the zygote and the workers hold none of serve's connections to the engine."""
    from sarp.serving.workers import worker_pids

    ix, eng, spec, before = served
    with Serve(ix, [spec], "--model-name", "llama", "--block-size", "16") as serve:
        seen = []
        deadline = time.monotonic() + 30
        while len(seen) < 200 and time.monotonic() < deadline:
            for q, answer in before.items():
                try:
                    status, _, body = raw(serve.port, "POST", "/query", q)
                except OSError:
                    continue  # not listening yet
                assert status == 503 or (status, body) == (200, answer), (status, body)
                seen.append(status)
        assert seen.count(200) > 0
        serve.wait_ready()
        pub_port = int(eng.publisher.endpoint.rsplit(":", 1)[1])
        assert pub_port in _tcp_peers(serve.pid)  # (serve's own: followed)
        zygote = [int(p) for p in Path(f"/proc/{serve.pid}/task/{serve.pid}/children")
                  .read_text().split()]
        for pid in zygote + worker_pids(serve.pid):
            assert pub_port not in _tcp_peers(pid), pid


def test_the_first_answers_read_holder_names_as_the_store_does(tmp_path):
    """The child's names (``first._holder_names``) are ``Holders``' of the store's: a
    name whose checksum fails is left out by both."""
    import lmdb

    from sarp.holders import Holders
    from sarp.store_lmdb import LmdbStore

    ix = tmp_path / "ix"
    with sarp.open(ix, durability="nosync") as index:
        for i, (holder, medium) in enumerate([("w1", "GPU"), ("w2", "CPU"), ("w3", "GPU")]):
            index.insert([100 + i, 200 + i], holder=holder, medium=medium)
    env = lmdb.open(str(ix), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"holders")) as txn:
        key = next(k for k, v in txn.cursor() if k.startswith(b"i:") and v.startswith(b"w2"))
        txn.put(b"s:" + key[2:], b"\0" * 8)  # w2's sum no longer matches
    env.close()
    loaded = first.Loaded(ix)
    ours = dict(loaded.holders.names)
    loaded.close()
    store = LmdbStore(ix, readonly=True)
    with store.read() as r:
        theirs = Holders(r.holder_names()).names
    store.close()
    assert ours == theirs and len(ours) == 2 and ("w2", "CPU") not in ours.values()
