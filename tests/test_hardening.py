"""Faults from outside that must never stop ``sarp serve`` nor make it claim more than
the engines hold (issue 23): real ``sarp serve`` processes, real ZeroMQ sockets on
loopback, hostile engines played by threads of this process.  Each test names the
numbered item of the issue it holds."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from servekit import Serve, call, match, metrics, source_metric

import sarp
from sarp.bench.cluster import EnginePublisher, HostileEngine, SimEngine
from sarp.serving import workers
from sarp.serving.applier import apply
from sarp.serving.events import decode, encode_batch


def chain(rng: random.Random, n: int = 4) -> list[int]:
    return [rng.getrandbits(63) for _ in range(n)]


def healthy_engine(name: str) -> SimEngine:
    return SimEngine(name, 2000, EnginePublisher(zmq.Context.instance()))


def spec(name: str, pub) -> str:
    return f"{name}={pub.endpoint},{pub.replay_endpoint}"


def held_by(port: int, hashes: list[int], instance: str) -> int:
    status, body = match(port, {"block_hashes": hashes})
    assert status == 200, body
    return next((s["matched_blocks"] for s in body["instances"]
                 if s["instance"] == instance), 0)


def test_item1_a_bad_event_is_counted_and_serve_http_goes_on(tmp_path):
    eng = healthy_engine("good")
    try:
        with Serve(tmp_path / "ix", [spec("good", eng.publisher)]) as serve:
            serve.wait_ready()
            # vLLM 0.33's own publisher sent this: a store with a repeated hash
            eng.publisher.publish(encode_batch([("stored", [5, 6, 5], None, "GPU"),
                                                ("stored", [7, 8], None, "GPU")],
                                               ts=time.time(), dp_rank=0))
            serve.wait_for(lambda: held_by(serve.port, [7, 8], "good#0") == 2,
                           what="the good store")
            time.sleep(1.5)  # several status writes, each with the bad event's count
            assert serve.alive()
            got = metrics(serve.port)
            key = ("sarp_source_bad_events_total",
                   (("kind", "repeated_hash"), ("source", "good")))
            assert got.get(key) == 1.0, sorted(k for k in got if "bad" in k[0])
            assert held_by(serve.port, [5, 6], "good#0") == 0  # the bad store: not applied
    finally:
        eng.publisher.close()


def test_item7_a_hostile_replay_endpoint_stalls_nobody_and_sigterm_stops_serve(tmp_path):
    rng = random.Random(7)
    good = healthy_engine("good")
    bad = HostileEngine(zmq.Context.instance())
    try:
        serve = Serve(tmp_path / "ix", [spec("good", good.publisher), spec("bad", bad)],
                      "--replay-budget-s", "3", "--replay-idle-timeout-s", "1")
        with serve:
            serve.wait_ready()
            # The hostile endpoint trickles for as long as it is asked; meanwhile every
            # batch of the healthy engine reaches the index.
            for i in range(20):
                c = chain(rng)
                good.serve(c)
                serve.wait_for(lambda c=c: held_by(serve.port, c, "good#0") == len(c),
                               timeout_s=10, what=f"the healthy engine's batch {i}")
                time.sleep(0.25)
            assert bad.requests >= 1 and bad.sent > 100
            serve.wait_for(lambda: source_metric(serve.port, "failed_replays", "bad") >= 1,
                           timeout_s=20, what="the hostile replay counted as failed")
            assert source_metric(serve.port, "bad_frames", "bad") > 0
            assert held_by(serve.port, [1, 2], "bad") == 0  # nothing unproven claimed
            assert serve.peak_rss_bytes() < 600 << 20
            bad.requests = 0
            serve.wait_for(lambda: bad.requests >= 1, timeout_s=20,
                           what="the failed replay retried after its backoff")
            took_s = serve.stop()
        assert serve.proc.returncode == 0
        assert took_s < 5, took_s  # within one poll of the loop, replay or not
    finally:
        good.publisher.close()
        bad.close()


def test_item8_a_frame_over_the_limit_is_dropped_before_it_is_received(tmp_path):
    eng = healthy_engine("e")
    try:
        with Serve(tmp_path / "ix", [spec("e", eng.publisher)],
                   "--max-frame-bytes", str(1 << 20), "--replay-idle-timeout-s", "1") as serve:
            serve.wait_ready()
            eng.serve([11, 12])
            serve.wait_for(lambda: held_by(serve.port, [11, 12], "e#0") == 2, what="11, 12")
            before = serve.peak_rss_bytes()
            big = encode_batch([("stored", [21, 22], None, "GPU")], ts=time.time(), dp_rank=0)
            big = msgpack.packb([time.time(), [{"type": "BlockStored", "block_hashes": [21],
                                                "parent_block_hash": None,
                                                "extra_keys": b"x" * (48 << 20)}], 0])
            eng.publisher.publish(big)
            rng = random.Random(8)

            def later_batch_applied() -> bool:
                c = chain(rng)
                eng.serve(c)
                time.sleep(0.2)
                return held_by(serve.port, c, "e#0") == len(c)

            serve.wait_for(later_batch_applied, timeout_s=30, what="a batch after the big one")
            assert serve.alive()
            assert source_metric(serve.port, "disconnects", "e") >= 1
            assert held_by(serve.port, [21], "e#0") == 0
            assert serve.peak_rss_bytes() - before < 24 << 20  # the 48 MiB never landed
    finally:
        eng.publisher.close()


def test_item8_the_python_decoder_takes_a_frame_over_msgpacks_default_buffer():
    # 101 MiB: over the Unpacker's default 100 MiB buffer, which raised BufferFull
    payload = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [3],
                                    "parent_block_hash": None,
                                    "extra_keys": b"x" * (101 << 20)}]])
    batch = decode(payload)
    assert batch.events[0].block_hashes.tolist() == [3]


def test_item9_through_serve_an_unchained_store_claims_nothing_under_it(tmp_path):
    eng = healthy_engine("e")
    x, y, z = 11, 22, 33
    try:
        with Serve(tmp_path / "ix", [spec("e", eng.publisher)]) as serve:
            serve.wait_ready()
            eng.publisher.publish(encode_batch(
                [("stored", [x], None, "GPU"), ("stored", [y], x, "GPU"),
                 ("stored", [y], None, "GPU"), ("stored", [z], y, "GPU"), ("stored", [7], None,
                                                                           "GPU")],
                ts=time.time(), dp_rank=0))
            serve.wait_for(lambda: held_by(serve.port, [7], "e#0") == 1, what="the batch")
            assert held_by(serve.port, [x, y, z], "e#0") <= 2  # the engine holds x, y
    finally:
        eng.publisher.close()


@pytest.mark.parametrize("same_batch", [True, False])
def test_item9_a_refused_store_lets_nothing_hang_under_its_hashes(tmp_path, same_batch):
    """Hashes the engine does not chain: ``[Y]`` stored after X, then ``[Y]`` as a root
    (refused: a chain conflict), then ``[Z]`` after Y.  The engine holds X, Y for the
    query X, Y, Z; the index may answer less, never 3."""
    x, y, z = 11, 22, 33
    events = [("stored", [x], None, "GPU"), ("stored", [y], x, "GPU"),
              ("stored", [y], None, "GPU"), ("stored", [z], y, "GPU")]
    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        if same_batch:
            stats = apply(index, "e", decode(encode_batch(events)))
            conflicts = stats.bad_events["chain_conflict"]
        else:
            conflicts = sum(apply(index, "e", decode(encode_batch([e]))).bad_events[
                "chain_conflict"] for e in events)
        assert conflicts == 1
        assert index.match([x, y, z]).by_holder.get("e", 0) <= 2
        assert index.check() == []


# -- the HTTP side ----------------------------------------------------------------------------


@pytest.fixture
def served(tmp_path):
    """sarp serve --http (2 workers, short connection timeouts) following one engine."""
    eng = healthy_engine("e")
    eng.serve([11, 12, 13])
    serve = Serve(tmp_path / "ix", [spec("e", eng.publisher)], "--hash-scheme",
                  "vllm-sha256-cbor", "--hash-seed", "0", "--http-request-timeout-s", "1",
                  "--http-idle-timeout-s", "2")
    try:
        serve.wait_ready()
        serve.wait_for(lambda: held_by(serve.port, [11, 12, 13], "e#0") == 3, what="a chain")
        yield serve
    finally:
        serve.stop()
        eng.publisher.close()


def worker_pids(pid: int) -> set[int]:
    """serve's HTTP workers (the zygote's children)."""
    return set(workers.worker_pids(pid))


def healthz_all_answered(port: int, probes: int, timeout_s: float) -> list[str]:
    """Probe /healthz ``probes`` times; the failures (each bounded by ``timeout_s``)."""
    failures = []
    for _ in range(probes):
        try:
            status, _ = call(port, "GET", "/healthz", timeout_s=timeout_s)
            if status != 200:
                failures.append(str(status))
        except OSError as exc:
            failures.append(repr(exc))
        time.sleep(0.1)
    return failures


def test_item2_large_token_requests_are_bounded_and_hashed_off_the_loop(served):
    port = served.port
    huge = b'{"token_ids": [' + b"1," * ((4 << 20) - 32) + b'1], "block_size": 1}'  # 8 MiB
    status, body = call(port, "POST", "/v1/match", huge, timeout_s=30)
    assert status == 413 and body["field"] == "token_ids", body
    # The most one request may hash: 262,144 blocks of one token, vLLM's scheme, two at
    # once while /healthz is probed (before, two of these stopped the service 11.6 s)
    biggest = json.dumps({"token_ids": list(range(1 << 18)), "block_size": 1}).encode()
    answers: list = []
    threads = [threading.Thread(target=lambda: answers.append(
        call(port, "POST", "/v1/match", biggest, timeout_s=60)[0])) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    failures = healthz_all_answered(port, 6, timeout_s=1.0)
    for t in threads:
        t.join(timeout=60)
    assert answers == [200, 200]
    assert failures == []


def test_item3_a_stopped_worker_is_dealt_nothing_and_replaced(served):
    pids = worker_pids(served.pid)
    assert len(pids) == 2
    stopped = min(pids)
    os.kill(stopped, signal.SIGSTOP)
    try:
        time.sleep(2.0)  # its heartbeat goes stale
        for i in range(20):  # new connections: each answered, none dealt to the stopped one
            status, body = match(served.port, {"block_hashes": [11, 12, 13]}, timeout_s=3)
            assert status == 200 and body["matched_blocks"] == 3, (i, body)
        served.wait_for(lambda: stopped not in worker_pids(served.pid)
                        and len(worker_pids(served.pid)) == 2, timeout_s=30,
                        what="the stopped worker replaced")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
    assert match(served.port, {"block_hashes": [11]})[1]["matched_blocks"] == 1


def test_item15_out_of_descriptors_serve_and_its_http_go_on(tmp_path):
    """serve out of file descriptors (its limit met, as under a flood of engines): its
    dealer's accepts and its status writes fail, are counted, and are made again; once
    descriptors are free, the connection that waited is answered and nothing stopped."""
    import resource

    eng = healthy_engine("e0")
    serve = Serve(tmp_path / "ix", [spec("e0", eng.publisher)], workers=1)
    try:
        serve.wait_ready()
        limits = resource.prlimit(serve.pid, resource.RLIMIT_NOFILE)
        assert {"0", "1", "2"} <= set(os.listdir(f"/proc/{serve.pid}/fd"))
        answered: dict = {}

        def ask() -> None:
            answered["healthz"] = call(serve.port, "GET", "/healthz", timeout_s=30)

        asking = threading.Thread(target=ask)
        # descriptors below 3 only: every new one fails (EMFILE), the open ones go on
        resource.prlimit(serve.pid, resource.RLIMIT_NOFILE, (3, limits[1]))
        try:
            # the accept blocked already holds the number it will give (Linux takes
            # it before waiting): one connection still gets through, the next waits
            assert call(serve.port, "GET", "/healthz", timeout_s=5)[0] == 200
            asking.start()
            time.sleep(1.5)  # accepts fail every 0.05 s, status writes every 0.5 s
            assert "healthz" not in answered and serve.alive()
        finally:
            resource.prlimit(serve.pid, resource.RLIMIT_NOFILE, limits)
        asking.join(30)
        assert answered["healthz"][0] == 200 and serve.alive()
        counted = {}

        def both_counted() -> bool:
            counted.update(metrics(serve.port))
            return (counted.get(("sarp_http_deal_errors_total", ()), 0) >= 1
                    and counted.get(("sarp_file_errors_total", ()), 0) >= 1)

        serve.wait_for(both_counted, timeout_s=10, what="the failures counted")
        assert serve.log.read_text().count("accepting an HTTP connection failed") == 1
        assert call(serve.port, "GET", "/readyz")[0] == 200
    finally:
        serve.stop()
        eng.publisher.close()


def test_item16_serve_follows_hundreds_of_engines(tmp_path):
    """400 engine ranks in the sources file: ZeroMQ's default of 1,023 sockets held
    about 250 (and the next one stopped serve); serve follows them all, answers, and
    one more registered at runtime is followed too."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:  # about 6 descriptors an engine
        pytest.skip(f"the hard open-files limit ({hard}) holds fewer than 400 engines")
    eng = healthy_engine("live")
    listed = tmp_path / "engines.yaml"
    base = 41_000  # nothing listens on these: their replays go unanswered, then retried
    listed.write_text("engines:\n" + "".join(
        f"  - e{i}=tcp://127.0.0.1:{base + 2 * i},tcp://127.0.0.1:{base + 2 * i + 1}\n"
        for i in range(400)))
    serve = Serve(tmp_path / "ix", [spec("live", eng.publisher)], "--sources-file",
                  str(listed), "--replay-idle-timeout-s", "0.5", workers=1)
    try:
        serve.wait_for(lambda: len(call(serve.port, "GET", "/workers")[1]) == 401,
                       timeout_s=60, what="401 engines followed")
        chain = [5, 6, 7]
        eng.serve(chain)
        serve.wait_for(lambda: held_by(serve.port, chain, "live#0") == 3, what="live's blocks")
        body = {"instance_id": 9999, "endpoint": "tcp://127.0.0.1:40998",
                "replay_endpoint": "tcp://127.0.0.1:40999"}
        assert call(serve.port, "POST", "/register", json.dumps(body).encode())[0] == 201
        serve.wait_for(lambda: len(call(serve.port, "GET", "/workers")[1]) == 402,
                       what="the one registered")
    finally:
        serve.stop()
        eng.publisher.close()


def raw(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def test_item4_an_oversize_length_is_refused_at_once_and_slow_clients_are_cut(served):
    head = (b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1099511627776\r\n\r\n")
    answer = raw(served.port, head + b'{"block_hashes": [')
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 413 " in status_line, answer[:200]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["field"] == "body"
    idle = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(100)]
    half = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(40)]
    for s in half:
        s.sendall(b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Le")
    deadline = time.monotonic() + 20
    for s in idle + half:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        assert s.recv(100) == b""  # closed by serve (a timeout here would raise)
        s.close()
    got = metrics(served.port)
    assert got[("sarp_http_connections_closed_total", (("reason", "idle"),))] >= 1
    assert got[("sarp_http_connections_closed_total", (("reason", "request"),))] >= 1
    assert match(served.port, {"block_hashes": [11]})[1]["matched_blocks"] == 1


def test_item5_every_error_has_the_json_shape(served):
    status, body = call(served.port, "GET", "/nowhere")
    assert status == 404 and body["field"] == "path" and body["error"]
    status, body = call(served.port, "GET", "/v1/match")
    assert status == 405 and body["field"] == "method" and body["error"]


def test_item5_beyond_loopback_needs_a_token_and_a_token_is_checked(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sarp.cli", "serve", "--index",
                          str(tmp_path / "ix"), "--source", "e=tcp://127.0.0.1:9",
                          "--http", "0.0.0.0:9"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--http-token-file" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "ix").exists()
    (tmp_path / "token").write_text("s3cret-token\n")
    eng = healthy_engine("e")
    try:
        with Serve(tmp_path / "ix", [spec("e", eng.publisher)], "--http-token-file",
                   str(tmp_path / "token")) as serve:
            serve.wait_ready()  # /readyz and /healthz ask for no token
            body = json.dumps({"block_hashes": [1]}).encode()
            status, answer = call(serve.port, "POST", "/v1/match", body)
            assert status == 401 and answer["field"] == "Authorization"
            assert call(serve.port, "GET", "/metrics")[0] == 401
            status, answer = call(serve.port, "POST", "/v1/match", body,
                                  headers={"Authorization": "Bearer s3cret-token"})
            assert status == 200 and answer["matched_blocks"] == 0
    finally:
        eng.publisher.close()


def test_item6_the_c_parse_answers_as_the_general_one_on_every_body(monkeypatch):
    from sarp import native
    from sarp.serving import http as http_mod

    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}: there is no C parse to compare")
    config = http_mod.HttpConfig("ix", "m")
    rng = random.Random(6)
    spaces = [b"", b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c", b"\xa0", b"  \n"]

    def outcome(body: bytes):
        try:
            kw = http_mod.parse_match(body, config)
        except http_mod.BadRequest as exc:
            return ("refused", exc.field, exc.status)
        return ("ok", kw["hashes"].tolist(), kw.get("block_size"))

    bodies = []
    for _ in range(3000):
        ws = rng.choices(spaces, weights=[8, 4, 2, 2, 2, 1, 1, 1, 2], k=6)
        hashes = b",".join(str(rng.choice([0, 1, 2**64 - 1, -1, rng.getrandbits(63)])).encode()
                           + rng.choice(spaces) for _ in range(rng.randrange(0, 5)))
        tail = rng.choice([b"", b', "block_size": 16', b', "x": 1', b",", b"]"])
        bodies.append(ws[0] + b"{" + ws[1] + b'"block_hashes"' + ws[2] + b":" + ws[3] + b"["
                      + hashes + b"]" + tail + ws[4] + b"}" + ws[5])
    with native.forced("c"):
        fast = [outcome(b) for b in bodies]
        taken = sum(http_mod._with_fast_block_hashes(b) is not None for b in bodies)
    with native.forced("python"), native.Tally() as tally:  # the general parse only
        general = [outcome(b) for b in bodies]
    assert tally.c("u64_array") == 0
    assert taken > 300  # the C path ran on many of them
    assert [i for i, (a, b) in enumerate(zip(fast, general, strict=True)) if a != b] == []


# -- records that pass their checksum but lie (item 14) ----------------------------------------


def test_item14_a_holder_named_twice_in_a_record_is_damage_on_both_paths():
    import numpy as np

    from sarp import native, verify
    from sarp.errors import CorruptRecordError
    from sarp.segment import Segment

    for nh in (2, 40):  # pair by pair in C, and through its bitmap
        ids = np.arange(1, nh + 1, dtype=np.uint16)
        ids[-1] = ids[0]
        seg = Segment(7, 0, None, np.array([5, 6, 7], np.uint64), ids,
                      np.ones((nh, 3), np.uint8))
        record, query = seg.encode(), np.array([5, 6, 7], "<u8").tobytes()
        with pytest.raises(CorruptRecordError, match="appears twice") as python_error:
            verify.examine_py(7, record, query, 0, None)
        with pytest.raises(CorruptRecordError) as either:
            verify.examine(7, record, query, 0, None)
        assert str(either.value) == str(python_error.value)
        if native.AVAILABLE:
            with native.forced("c"):
                assert native.C.examine(record, query, 0, 0, False) == -5  # BAD_HOLDERS


def test_item14_a_start_past_the_query_gets_zero_blocks_on_both_paths():
    import numpy as np

    from sarp import native, verify
    from sarp.segment import Segment

    seg = Segment(3, 4, 99, np.array([5, 6], np.uint64), np.array([1], np.uint16),
                  np.ones((1, 2), np.uint8))
    record, query = seg.encode(), np.array([1, 2], "<u8").tobytes()  # 2 blocks, start 4
    expected = verify.examine_py(3, record, query, 4, 99)
    assert expected == (0, 0, [1], [0])
    if native.AVAILABLE:
        with native.forced("c"):
            assert native.C.examine(record, query, 4, 99, True) == expected


_HEAD_LIES = r"""
import sys, sarp
with sarp.open(sys.argv[1], durability="nosync") as index:
    index.insert([1, 2], holder="e")
    index.directory.add(99, index.directory.lookup(1))  # names segment 1 for hash 99
    try:
        index.insert([99], holder="e")
        print("inserted")
    except sarp.CorruptRecordError as exc:
        print("refused:", exc)
    print(index.match([1, 2]).by_holder)
"""


@pytest.mark.parametrize("pure", ["", "1"])
def test_item14_an_insert_sent_to_a_record_of_another_head_refuses_instead_of_looping(
        tmp_path, pure):
    env = {**os.environ, "SARP_PURE_PYTHON": pure} if pure else \
        {k: v for k, v in os.environ.items() if k != "SARP_PURE_PYTHON"}
    out = subprocess.run([sys.executable, "-c", _HEAD_LIES, str(tmp_path / "ix")], env=env,
                         capture_output=True, text=True, timeout=60)  # it looped for ever
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: segment") and "named for first hash 99" in lines[0]
    assert lines[1] == "{'e': 2}"


# -- errors at the store boundary (item 13) --------------------------------------------------


def test_item13_a_damaged_meta_counter_is_a_sarp_error(tmp_path):
    import lmdb

    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        index.insert([1, 2], holder="e")
    env = lmdb.open(str(tmp_path / "ix"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"next_seg_id", b"\x01\x02\x03", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(sarp.SarpError, match="next_seg_id"), \
            sarp.open(tmp_path / "ix", durability="nosync") as index:
        index.insert([7, 8], holder="e")


def test_item13_a_folder_the_system_refuses_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "a-file").write_text("")
    for path in (tmp_path / "a-file" / "ix", Path("/proc/sarp-ix")):
        out = subprocess.run([sys.executable, "-m", "sarp.cli", "serve", "--index", str(path),
                              "--source", "e=tcp://127.0.0.1:9"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and str(path) in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_item13_valkey_errors_reach_callers_as_sarp_errors():
    import valkey
    from test_valkey import shared_server

    server = shared_server()
    url = server.url("wrongtype")
    with sarp.open(url, durability="nosync") as index:
        index.insert([1, 2], holder="e")
    with valkey.Valkey(port=server.port) as client:
        client.delete(b"sarp:{wrongtype}:seg")
        client.set(b"sarp:{wrongtype}:seg", b"not a hash")  # another program's key
    with pytest.raises(sarp.SarpError, match="refused a command"), \
            sarp.open(url, readonly=True) as reader:
        reader.match([1, 2])
    # an outage at close: the index was open, Valkey goes away, close() still returns
    own = type(server)()
    try:
        index = sarp.open(own.url("outage"), durability="nosync")
        index.insert([3], holder="e")
        own.stop()
        with contextlib.suppress(sarp.SarpError):  # valkey's own errors are not allowed
            index.close()
    finally:
        own.stop()


# -- Valkey: a reset server, a trimmed log, a stalled server (items 10-12) ---------------------


def _chains(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.getrandbits(63) for _ in range(4)] for _ in range(n)]


def test_item10_a_reader_across_a_valkey_reset_names_the_new_holders(tmp_path):
    from sarp.bench.valkey_server import ValkeyServer

    server = ValkeyServer()
    port = server.port
    url = server.url("reset")
    chains = _chains(10, 30)
    try:
        writer = sarp.open(url, durability="nosync")
        for c in chains:
            writer.insert(c, holder="old")
        reader = sarp.open(url, readonly=True)
        assert reader.match(chains[0]).by_holder == {"old": 4}
        writer.close()
        server.stop()
        server = ValkeyServer(port=port)  # back empty, on the same port
        with sarp.open(url, durability="nosync") as again:  # the same writes, other holder
            for c in chains:
                again.insert(c, holder="new")
            # the new index's counters stand where the old one's did when the reader
            # last caught up: only its id tells them apart
            for c in chains:
                assert reader.match(c).by_holder == {"new": 4}
        assert reader.stats()["index_reloads"] == 1
        reader.close()
    finally:
        server.stop()


def test_item11_a_log_trimmed_by_another_client_makes_readers_reload(tmp_path):
    import valkey
    from test_valkey import shared_server

    server = shared_server()
    url = server.url("trimmed")
    chains = _chains(11, 60)
    with sarp.open(url, durability="nosync") as writer:
        for c in chains[:20]:
            writer.insert(c, holder="w")
        with sarp.open(url, readonly=True) as reader:
            assert all(reader.match(c).num_blocks == 4 for c in chains[:20])
            for c in chains[20:]:
                writer.insert(c, holder="w")
            with valkey.Valkey(port=server.port) as client:
                # not sarp's doing: exactly, not approximately (which trims whole nodes)
                client.xtrim(b"sarp:{trimmed}:log", maxlen=5, approximate=False)
            problems = writer.check()
            assert any(p.startswith("log: entries") for p in problems), problems
            assert sum(reader.match(c).num_blocks == 4 for c in chains) == 60
            assert reader.stats()["log_holes"] == 1
            assert reader.check() == [p for p in problems if p.startswith("log:")]


def test_item12_a_standby_waits_out_a_stalled_server_and_the_old_writer_is_told(tmp_path):
    from sarp.bench.valkey_server import ValkeyServer
    from sarp.errors import LeaseLostError

    server = ValkeyServer()
    url = server.url("stall")
    try:
        writer = sarp.open(url, durability="nosync", lease_s=2)
        writer.insert([1, 2], holder="a")
        standby: dict = {}

        def take_over() -> None:
            try:
                standby["index"] = sarp.open(url, durability="nosync", lease_s=2,
                                             wait_for_lease_s=60)
            except Exception as exc:  # noqa: BLE001 - the test reports it
                standby["error"] = exc

        thread = threading.Thread(target=take_over)
        thread.start()
        time.sleep(0.5)  # the standby is waiting
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(2.5)  # the writer's lease runs out while the server is stopped
            with pytest.raises(LeaseLostError):
                writer.insert([3], holder="a")
            time.sleep(10)  # past the clients' 10 s socket timeout: the standby retries
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        thread.join(timeout=60)
        assert "error" not in standby, standby.get("error")
        new = standby["index"]
        assert new.match([1, 2]).by_holder == {"a": 2}
        new.insert([1, 2, 5], holder="b")
        with pytest.raises(LeaseLostError):
            writer.insert([4], holder="a")
        with contextlib.suppress(sarp.SarpError):
            writer.close()
        new.close()
    finally:
        server.stop()


def test_serve_on_valkey_outlives_a_valkey_restart_and_ends_equal_to_the_engine(tmp_path):
    from sarp.bench.valkey_server import ValkeyServer

    server = ValkeyServer(aof=True, folder=tmp_path / "valkey")
    port, url = server.port, server.url("outage")
    eng = healthy_engine("e")
    rng = random.Random(12)
    roots = [chain(rng, 3) for _ in range(5)]
    try:
        with Serve(url, [spec("e", eng.publisher)], "--lease-s", "10",
                   log=tmp_path / "serve.log") as serve:
            serve.wait_ready()
            for i in range(120):
                eng.serve(rng.choice(roots) + chain(rng, 3))
                if i == 40:
                    server.stop()  # its AOF holds what was acknowledged
                if i == 60:
                    server = ValkeyServer(aof=True, folder=tmp_path / "valkey", port=port)
                time.sleep(0.02)
            held = set(eng.cache)

            def equal() -> bool:
                with sarp.open(url, readonly=True) as reader:
                    return set(reader.blocks_of("e#0").tolist()) == held

            serve.wait_for(equal, timeout_s=60, what="the index equal to the engine's cache")
            assert serve.alive()
            assert metrics(serve.port).get(("sarp_store_errors_total", ()), 0) >= 1
    finally:
        eng.publisher.close()
        server.stop()


# -- the soak, 30 s (make soak runs it for 120 s and also holds /healthz's p99) ----------------


@pytest.mark.slow
@pytest.mark.parametrize("store", ["lmdb", "valkey", "lmdb-in-process"])
def test_soak_30s_every_fault_at_once_and_no_false_answer(tmp_path, store):
    """(``lmdb-in-process``: HTTP on serve's own thread, ``--http-workers 0``: the same
    faults but the stopped worker, and the same answers.)"""
    out = subprocess.run([sys.executable, "-m", "sarp.bench.soak", "--seconds", "30",
                          "--json", str(tmp_path / "soak.json"),
                          *(["--valkey"] if store == "valkey" else []),
                          *(["--http-workers", "0"] if store == "lmdb-in-process" else [])],
                         capture_output=True, text=True, timeout=600)
    assert (tmp_path / "soak.json").exists(), out.stdout[-3000:] + out.stderr[-5000:]
    result = json.loads((tmp_path / "soak.json").read_text())
    print(json.dumps(result, indent=1))  # the figures, in the test log
    assert result["answers_checked"] > 1000
    assert result["false_answers"] == 0, result["false_samples"]
    assert result["serve_stopped_by_itself"] == []
    # killed and replaced before serve's SIGKILL (a thread of serve's is not stopped)
    assert result["worker_replaced_by_serve"] or store == "lmdb-in-process"
    assert result["max_request_errors"] == 0  # (failed probes are timeouts: not held here)
    assert result["rss_max_mib"] < 1536
    assert len(result["restart_to_ready_s"]) == 3
    assert out.returncode in (0, 1)  # 1: only when a timing (p99) missed; not asserted here


def test_item17_engines_past_max_engines_are_refused_and_nothing_changes(tmp_path):
    """`/register` is open to any client with the token: past `--max-engines` one more
    is refused (409, naming the flag), the engines followed go on, and a place freed by
    `/unregister` can be taken."""
    eng = healthy_engine("a")

    def register(i: int) -> int:
        body = {"instance_id": i, "endpoint": f"tcp://127.0.0.1:{42_000 + 2 * i}",
                "replay_endpoint": f"tcp://127.0.0.1:{42_001 + 2 * i}"}
        status, answer = call(serve.port, "POST", "/register", json.dumps(body).encode())
        if status != 201:
            assert "--max-engines" in answer["error"], answer
        return status

    serve = Serve(tmp_path / "ix", [spec("a", eng.publisher)], "--max-engines", "3", workers=1)
    try:
        serve.wait_ready()
        assert [register(i) for i in (1, 2, 3)] == [201, 201, 409]
        eng.serve([4, 5])
        serve.wait_for(lambda: held_by(serve.port, [4, 5], "a#0") == 2, what="a's blocks")
        body = json.dumps({"instance_id": 1}).encode()
        assert call(serve.port, "POST", "/unregister", body)[0] == 200
        assert register(3) == 201 and serve.alive()
        serve.wait_for(lambda: sorted(str(w["instance_id"]) for w in
                                      call(serve.port, "GET", "/workers")[1]) == ["2", "3", "a"],
                       what="the engines followed")
    finally:
        serve.stop()
        eng.publisher.close()
