"""`sarp serve --http` against a real server on loopback: a real `sarp serve` process
following a simulated engine over ZeroMQ, HTTP worker processes with readonly opens,
clients speaking plain HTTP/1.1."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from servekit import call, free_port

import sarp
from sarp.bench.cluster import EnginePublisher
from sarp.serving.events import encode_batch


def match(port: int, payload: object) -> tuple[int, dict]:
    return call(port, "POST", "/v1/match", json.dumps(payload).encode())


@pytest.fixture(scope="module", params=["2", "0"], ids=["workers", "in-process"])
def service(tmp_path_factory, request):
    """sarp serve --http with one engine (DP rank 0) that stored a few chains: with 2
    worker processes, and with HTTP on a thread of serve's own (``--http-workers 0``:
    the same answers, from the writer's index)."""
    folder = tmp_path_factory.mktemp("http")
    pub = EnginePublisher(zmq.Context.instance())
    port = free_port()
    cmd = [sys.executable, "-m", "sarp.cli", "serve", "--index", str(folder / "ix"),
           "--durability", "nosync", "--source", f"eng={pub.endpoint},{pub.replay_endpoint}",
           "--http", f"127.0.0.1:{port}", "--http-workers", request.param, "--hash-scheme",
           "vllm-sha256-cbor", "--hash-seed", "0", "--block-size", "16"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    tokens = list(range(100, 164))
    hashes = sarp.hash_blocks(tokens, 16, scheme="vllm-sha256-cbor", seed="0").tolist()
    pub.publish(encode_batch([("stored", [1, 2, 3, 2**64 - 5], None, "GPU"),
                              ("stored", [1, 2], None, "CPU_PINNED"),
                              ("stored", hashes, None, "GPU")], dp_rank=0))
    pub.publish(encode_batch([("stored", [7, 8], None, "GPU"), ("stored", [7], None, "GPU")],
                             dp_rank=1))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                status, body = call(port, "GET", "/readyz", timeout_s=2)
                if status == 200:
                    s, m = match(port, {"block_hashes": [7]})
                    if s == 200 and m["matched_blocks"] == 1:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            proc.kill()
            raise AssertionError(f"sarp serve --http never got ready: {proc.stderr.read()}")
        yield {"port": port, "tokens": tokens, "proc": proc, "workers": int(request.param)}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        pub.close()


def test_match_answers_the_shape_of_router_score(service):
    status, body = match(service["port"], {"block_hashes": [1, 2, 3, -5, 99],
                                           "block_size": 16})
    assert status == 200
    assert body["matched_blocks"] == 4
    (best,) = body["instances"]  # eng#1 holds none of these blocks
    assert best == {"instance": "eng#0", "engine": "eng", "dp_rank": 0, "matched_blocks": 4,
                    "matched_tokens": 64, "by_medium": {"GPU": 4}, "score": 4.0}
    status, body = match(service["port"], {"block_hashes": [7, 8]})
    assert [(s["instance"], s["matched_blocks"]) for s in body["instances"]] == [("eng#1", 2)]


def test_match_by_token_ids_in_the_engines_scheme(service):
    status, body = match(service["port"], {"token_ids": service["tokens"] + [1, 2, 3]})
    assert status == 200 and body["matched_blocks"] == 4
    assert body["instances"][0]["matched_tokens"] == 64


def test_many_requests_in_one_call_get_one_answer_each_in_order(service):
    chains = [[1, 2, 3, -5, 99], [7, 8], [], [42], [1, 2]]
    status, body = match(service["port"], {"requests": chains, "block_size": 16})
    assert status == 200
    one_by_one = [match(service["port"], {"block_hashes": c, "block_size": 16})[1]
                  for c in chains]
    assert body["results"] == one_by_one
    assert [r["matched_blocks"] for r in body["results"]] == [4, 2, 0, 0, 2]


def test_weights_per_medium(service):
    status, body = match(service["port"], {"block_hashes": [1, 2],
                                           "weights": {"GPU": 0.5, "CPU": 1.0}})
    assert status == 200
    assert body["instances"][0]["by_medium"] == {"CPU": 2}
    assert body["instances"][0]["score"] == 2.0


@pytest.mark.parametrize("body, field", [
    (b"not json", "body"),
    (b"[1, 2]", "body"),
    (b"{}", "block_hashes"),
    (json.dumps({"block_hashes": "1,2"}).encode(), "block_hashes"),
    (json.dumps({"block_hashes": [1, "2"]}).encode(), "block_hashes[1]"),
    (json.dumps({"block_hashes": [1, 2.5]}).encode(), "block_hashes[1]"),
    (json.dumps({"block_hashes": [True]}).encode(), "block_hashes[0]"),
    (json.dumps({"block_hashes": [2**64]}).encode(), "block_hashes[0]"),
    (json.dumps({"block_hashes": [-(2**63) - 1]}).encode(), "block_hashes[0]"),
    (json.dumps({"block_hashes": [1], "block_size": 0}).encode(), "block_size"),
    (json.dumps({"block_hashes": [1], "block_size": "16"}).encode(), "block_size"),
    (json.dumps({"block_hashes": [1], "weights": {"GPU": -1}}).encode(), "weights.GPU"),
    (json.dumps({"block_hashes": [1], "weights": [1]}).encode(), "weights"),
    (json.dumps({"block_hashes": [1], "extra": 1}).encode(), "extra"),
    (json.dumps({"token_ids": [-1]}).encode(), "token_ids[0]"),
    (json.dumps({"block_hashes": [1], "token_ids": [1]}).encode(), "block_hashes"),
    (b'{"block_hashes": [' + b"1," * (5 << 20) + b"1]}", "body"),
    (json.dumps({"requests": []}).encode(), "requests"),
    (json.dumps({"requests": [1, 2]}).encode(), "requests[0]"),
    (json.dumps({"requests": [[1], [2, "x"]]}).encode(), "requests[1][1]"),
    (json.dumps({"requests": [[1]], "block_hashes": [1]}).encode(), "block_hashes"),
])
def test_bad_input_gets_400_naming_the_field_and_the_server_stays_up(service, body, field):
    status, answer = call(service["port"], "POST", "/v1/match", body)
    assert status == (413 if len(body) > 8 << 20 else 400), answer  # too large: 413
    assert answer["field"] == field and answer["error"]
    assert match(service["port"], {"block_hashes": [7]})[1]["matched_blocks"] == 1


def test_eight_concurrent_clients_get_exact_answers(service):
    errors: list[str] = []

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", service["port"], timeout=10)
        try:
            for j in range(50):
                query = [1, 2, 3, 2**64 - 5][: 1 + (i + j) % 4] + [424242]
                conn.request("POST", "/v1/match", body=json.dumps({"block_hashes": query}),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                body = json.loads(resp.read())
                if resp.status != 200 or body["matched_blocks"] != len(query) - 1:
                    errors.append(f"client {i}: {resp.status} {body}")
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(f"client {i}: {exc!r}")
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []


def test_health_readiness_and_metrics_read_back_by_prometheus_client(service):
    port = service["port"]
    assert call(port, "GET", "/healthz")[0] == 200
    status, ready = call(port, "GET", "/readyz")
    assert status == 200 and ready["ready"] is True
    for _ in range(4):
        match(port, {"block_hashes": [1, 2]})
    # the worker asked folds its own counts at once, the other at its next fold (every
    # 0.1 s, from 1 s after its start): read until both have, within a deadline
    deadline = time.monotonic() + 10
    while True:
        status, text = call(port, "GET", "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in families.values() for s in f.samples}
        if samples[("sarp_matches_total", ())] >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert samples[("sarp_source_batches_total", (("source", "eng"),))] == 2
    assert samples[("sarp_source_events_total", (("source", "eng"),))] == 5
    assert samples[("sarp_source_restarts_total", (("source", "eng"),))] == 0
    # the 2 batches' commits (1 or 2, as they met the commit's wait) and their time
    assert 1 <= samples[("sarp_commits_total", ())] <= 2
    assert samples[("sarp_commit_seconds_total", ())] > 0
    assert ("sarp_source_seconds_since_last_applied", (("source", "eng"),)) in samples
    assert samples[("sarp_matches_total", ())] >= 4  # summed over the worker processes
    assert samples[("sarp_match_seconds_count", ())] >= 4
    assert samples[("sarp_index_blocks", ())] == 4 + 4 + 2
    assert samples[("sarp_ready", ())] == 1.0


def test_forked_workers_count_their_metrics_apart_without_asking_for_the_pid(tmp_path):
    """A worker's metrics swap prometheus_client's pid check at every update (a
    ``getpid`` system call per request) for the pid the fork hook keeps: workers forked
    from one zygote write files of their own, under that pid, summed by /metrics."""
    code = f"""
import os
from sarp.serving import http
http.import_for_workers({str(tmp_path)!r})
pids = []
for k in range(2):
    pid = os.fork()
    if pid == 0:
        own = http._pid() == os.getpid()
        counter = http._Metrics().matches  # prometheus_client imported now, in the worker
        http._PID[0] = 900000 + k  # the pid it counts under is the hook's, not getpid's
        for _ in range(3):
            counter.inc()
        os._exit(0 if own else 1)
    pids.append(pid)
assert all(os.waitpid(p, 0)[1] == 0 for p in pids), "a worker failed to count"
from prometheus_client import CollectorRegistry, multiprocess
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(registry.get_sample_value("sarp_matches_total"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == 6.0
    assert {"counter_900000.db", "counter_900001.db"} <= {
        p.name for p in tmp_path.glob("counter_*.db")}


def test_a_worker_answers_before_importing_prometheus_and_counts_it_all(tmp_path):
    """prometheus_client's import (25-35 ms) is off a restart's path: a worker answers
    and refuses with it not imported, and its first /metrics counts every one."""
    code = f"""
import sys
import sarp
from sarp.serving import http, wire
from sarp.serving.workers import HttpConfig
with sarp.open({str(tmp_path / "ix")!r}) as ix:
    ix.insert([1, 2], holder="e0")
http.import_for_workers({str(tmp_path / "m")!r})
index = sarp.open({str(tmp_path / "ix")!r}, readonly=True)
server = http.make_server(index, HttpConfig({str(tmp_path / "ix")!r}, {str(tmp_path / "m")!r}))
ask = server.routes["/v1/match"]["POST"]
answers = [ask(wire.Request("POST", "/v1/match", {{}}, body))
           for body in (b'{{"block_hashes": [1, 2]}}', b'{{"block_hashes": "x"}}')]
print([a.status for a in answers], "prometheus_client" in sys.modules)
print(server.routes["/metrics"]["GET"](wire.Request("GET", "/metrics", {{}}, b"")).body.decode())
"""
    (tmp_path / "m").mkdir()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    first, text = out.stdout.split("\n", 1)
    assert first == "[200, 400] False"
    samples = {s.name: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if not s.labels or s.name.endswith("_count")}
    assert (samples["sarp_matches_total"], samples["sarp_match_rejected_total"],
            samples["sarp_match_seconds_count"]) == (1, 1, 1)


def test_heartbeats_in_a_file_are_shared_with_a_spawned_worker(tmp_path):
    """A worker spawned afresh (the zygote gone) gets the heartbeats pickled as their
    file, and its stamps reach serve's map; an anonymous map is refused there."""
    import pickle

    from sarp.serving.workers import Heartbeats

    beats = Heartbeats(str(tmp_path / "beats"), 2)
    theirs = pickle.loads(pickle.dumps(beats))
    theirs[1] = 7.5
    assert (beats[0], beats[1], len(theirs)) == (0.0, 7.5, 2)
    with pytest.raises(TypeError, match="fork only"):
        pickle.dumps(Heartbeats(None, 2))


def test_a_request_without_a_full_block_matches_nothing(service):
    assert match(service["port"], {"block_hashes": []}) == (200, {"matched_blocks": 0,
                                                                 "instances": []})
    status, body = match(service["port"], {"token_ids": [1, 2, 3]})  # < one 16-token block
    assert status == 200 and body["matched_blocks"] == 0


def _healthz_pid(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/healthz")
    resp = conn.getresponse()
    assert resp.status == 200
    return json.loads(resp.read())["pid"]


def test_a_pool_of_keepalive_connections_is_spread_evenly_over_the_workers(service):
    # A gateway's connection pool: with SO_REUSEPORT's hash, 8 connections landed 7 on
    # one of two workers in one run of 5; dealt in turn they land 4 and 4.
    if not service["workers"]:  # one process: every connection is answered by serve
        assert {_healthz_pid(http.client.HTTPConnection("127.0.0.1", service["port"],
                                                        timeout=10))
                for _ in range(8)} == {service["proc"].pid}
        pid = service["proc"].pid  # no zygote, no worker: no child at all
        assert Path(f"/proc/{pid}/task/{pid}/children").read_text().split() == []
        return
    conns = [http.client.HTTPConnection("127.0.0.1", service["port"], timeout=10)
             for _ in range(8)]
    try:
        pids = [_healthz_pid(conn) for conn in conns]
        assert [_healthz_pid(conn) for conn in conns] == pids  # kept alive, same worker
    finally:
        for conn in conns:
            conn.close()
    assert sorted(pids.count(p) for p in set(pids)) == [4, 4]


def _gone(pid: int) -> bool:
    """The process has exited: every thread of it is a zombie, or it was reaped (the
    leader turns zombie before its other threads have closed the files they share).
    Read while the kernel reaps it, /proc answers ESRCH or ENOENT: both mean gone."""
    try:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
    except OSError:
        return True
    return all(state in "ZX" for state in states)


def _serve_http(folder, port: int) -> tuple[subprocess.Popen, list[str], set[int]]:
    """A `sarp serve --http` with 2 workers and a source that never publishes; its
    command and the workers' pids, once both answer."""
    cmd = [sys.executable, "-m", "sarp.cli", "serve", "--index", str(folder), "--source",
           "e=tcp://127.0.0.1:9", "--probe-after-s", "0", "--http", f"127.0.0.1:{port}",
           "--http-workers", "2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=5) for _ in range(2)]
            workers = {_healthz_pid(conn) for conn in conns}
            for conn in conns:
                conn.close()
            if len(workers) == 2:
                return proc, cmd, workers
            # one worker still starting: the dealer hands its turns to the one whose
            # loop already stamps its heartbeat
            raise OSError("one worker answers so far")
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("sarp serve --http never answered") from None
            time.sleep(0.1)


def _workers_answering(port: int) -> set[int]:
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=5) for _ in range(4)]
    try:
        return {_healthz_pid(conn) for conn in conns}
    finally:
        for conn in conns:
            conn.close()


def test_without_http_workers_serve_runs_a_worker_per_core_the_writer_leaves(tmp_path):
    """No --http-workers: ``default_workers()``, the usable cores less one (on this
    machine's affinity and quota, as the test process reads them; its bounds are its
    doctest's)."""
    from sarp.serving.workers import default_workers, worker_pids

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sarp.cli", "serve", "--index",
                             str(tmp_path / "ix"), "--source", "e=tcp://127.0.0.1:9",
                             "--http", f"127.0.0.1:{port}"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if call(port, "GET", "/healthz", timeout_s=2)[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "serve never answered"
            time.sleep(0.1)
        time.sleep(0.5)  # every worker is forked at once; none more comes
        assert len(worker_pids(proc.pid)) == default_workers()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_cpu_quota_bounds_the_cores_read_from_either_cgroup_version(tmp_path):
    from sarp.serving.workers import quota_cores

    group = tmp_path / "kube" / "pod7"
    group.mkdir(parents=True)
    (tmp_path / "kube" / "cpu.max").write_text("max 100000\n")  # the parent: no limit
    (group / "cpu.max").write_text("250000 100000\n")  # --cpus 2.5: 3 cores' worth
    assert quota_cores("0::/kube/pod7\n", tmp_path) == 3
    (tmp_path / "kube" / "cpu.max").write_text("150000 100000\n")  # a parent's is lower
    assert quota_cores("0::/kube/pod7\n", tmp_path) == 2
    assert quota_cores("0::/elsewhere\n", tmp_path) is None  # no group file: no quota
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert quota_cores("4:cpu:/\n", tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert quota_cores("4:cpu:/\n", tmp_path) is None


def test_a_worker_that_dies_is_replaced_and_nothing_is_refused_meanwhile(tmp_path):
    port = free_port()
    proc, _, workers = _serve_http(tmp_path / "ix", port)
    try:
        victim, survivor = sorted(workers)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        # Connections dealt to it in the instant it died die with it (the kernel may
        # release its files a little after it turns zombie); once serve has reaped it,
        # none can be.
        while os.path.exists(f"/proc/{victim}"):
            assert time.monotonic() < deadline, "serve never reaped the killed worker"
            time.sleep(0.01)
        while True:
            answering = _workers_answering(port)  # every connection is answered
            assert victim not in answering
            if len(answering) == 2:
                break
            assert time.monotonic() < deadline, f"only {answering} answer after a kill"
            time.sleep(0.2)
        assert survivor in answering
        assert match(port, {"block_hashes": [1, 2]}) == (200, {"matched_blocks": 0,
                                                               "instances": []})
        deadline = time.monotonic() + 10
        while True:  # the status file is rewritten every half second
            families = text_string_to_metric_families(call(port, "GET", "/metrics")[1])
            restarts = {s.name: s.value for f in families for s in f.samples}.get(
                "sarp_http_worker_restarts_total")
            if restarts == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert restarts == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_workers_leave_with_a_killed_serve_and_a_taken_port_changes_nothing(tmp_path):
    port = free_port()
    proc, cmd, workers = _serve_http(tmp_path / "ix", port)
    try:
        assert len(workers) == 2 and proc.pid not in workers
        # a second serve on the same port is refused before it opens its index
        other = subprocess.run([*cmd[:5], str(tmp_path / "other"), *cmd[6:]],
                               capture_output=True, text=True, timeout=60)
        assert other.returncode == 2
        assert f"--http 127.0.0.1:{port}: cannot listen there" in other.stderr
        assert not (tmp_path / "other").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # serve's end of each worker's socket pair closed with it: the workers exit
    # rather than answer from an index nobody writes any more
    deadline = time.monotonic() + 20
    while not all(_gone(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived serve"
        time.sleep(0.1)
    with pytest.raises(OSError):
        call(port, "GET", "/healthz", timeout_s=2)


def _parse_outcome(body: bytes):
    from sarp.serving.http import BadRequest, HttpConfig, parse_match

    try:
        out = parse_match(body, HttpConfig("ix", "m", block_size=16))
    except BadRequest as exc:
        return ("400", exc.field, str(exc))
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in out.items()}


def test_the_fast_block_hashes_parse_answers_as_the_general_one(monkeypatch):
    """Bodies that begin with block_hashes or token_ids skip Python ints
    (sarp._native.u64_array); on any body, valid or not, the outcome is the general
    parse's, 400 messages included."""
    import random

    import sarp.serving.http as http_mod
    from sarp import native

    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}: only the general parse runs")
    rng = random.Random(7)
    ints = [0, 1, -1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 2**64, -(2**63) - 1, 10**30]
    pieces = ["1.0", "1e5", "true", "null", '"7"', "01", "-0", "+1", "-", "[1]", "", " "]
    bodies = []
    for k in range(4000):
        items = [str(rng.choice(ints) if rng.random() < 0.3 else rng.getrandbits(64)
                     * rng.choice([1, 1, -1]) // rng.choice([1, 1, 2**rng.randint(0, 63)]))
                 for _ in range(rng.randint(0, 12))]
        if k >= 3000:  # token ids: mostly in range (u32), some just past it
            items = [str(rng.choice([0, 1, 2**32 - 1, 2**32, -1]) if rng.random() < 0.05
                         else rng.randrange(1 << 32)) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.2 and items:
            items[rng.randrange(len(items))] = rng.choice(pieces)
        sep = rng.choice([",", ", ", " ,", ",\n", "\t,\r"])
        array = "[" + rng.choice(["", " ", "\n"]) + sep.join(items) + rng.choice(["", " "]) + "]"
        tail = rng.choice(["", ', "block_size": 32', ', "weights": {"GPU": 1.0}',
                           ', "block_hashes": [5]', ', "block_hashes": []', ', "x": 1',
                           ', "block\\u005fhashes": []', ', "token_ids": [1]', ',', ' "a"'])
        head = rng.choice(['{"block_hashes":', ' { "block_hashes" : ', '{"block_size": 16, '
                           '"block_hashes": ']) if k < 3000 else rng.choice(
            ['{"token_ids":', ' { "token_ids" : ', '{"block_size": 4, "token_ids": '])
        bodies.append((head + array + tail + rng.choice(["}", " }", "}x", ""])).encode())
    fast_taken = [0, 0]  # block hashes, token ids
    with native.Tally() as tally:
        for k, body in enumerate(bodies):
            with native.forced("python"):
                expected = _parse_outcome(body)
            with native.forced("c"):
                field = b"block_hashes" if k < 3000 else b"token_ids"
                fast_taken[k >= 3000] += http_mod._with_fast_block_hashes(body, field) is not None
                assert _parse_outcome(body) == expected, body
    assert min(fast_taken) > 100  # the fast paths were exercised, not only refused
    assert tally.c("u64_array") >= sum(fast_taken) and tally.python("u64_array") >= len(bodies)


def _digits(rng, count: int) -> str:
    """A number of ``count`` digits (no leading zero)."""
    return str(rng.randrange(10 ** (count - 1) if count > 1 else 0, 10 ** count))


def test_short_token_ids_read_a_word_at_a_time_are_the_general_parse_s_or_refused():
    """Ids of up to 8 digits are read 8 bytes at a time (``digits_value`` and, past a
    sign, ``leading_digits`` in http.c):
    every length from 1 to 9 digits, leading zeros, signs and the array's end at each
    distance from the body's end give the general parse's ids, or None."""
    import random

    import orjson

    import sarp.serving.http as http_mod
    from sarp import native

    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}: only the general parse runs")
    rng = random.Random(5)
    odd = ["0", "00", "01", "-1", "-0", "1.5", "1e3", "true", "+1", "0x1", "9" * 8, "1" * 9]
    taken = refused = 0
    for _ in range(4000):
        items = [rng.choice(odd) if rng.random() < 0.05 else _digits(rng, rng.randint(1, 9))
                 for _ in range(rng.randint(0, 30))]
        sep = rng.choice([",", ", ", " , ", ",\n\t"])
        tail = rng.choice(["]}", '], "model_name": "m"}', "] }", "]" + " " * rng.randint(0, 9)
                           + "}"])
        body = ('{"token_ids": [' + rng.choice(["", " "]) + sep.join(items) + tail).encode()
        obj = http_mod._with_fast_block_hashes(body, b"token_ids")
        try:
            general = orjson.loads(body)["token_ids"]
        except orjson.JSONDecodeError:
            general = None
        if obj is None:
            refused += 1
            assert general is None or not all(
                type(v) is int and 0 <= v < 1 << 32 for v in general), body
            continue
        taken += 1
        assert obj["token_ids"].tolist() == general, body
    assert taken > 2000 and refused > 200


def test_token_ids_parsed_in_c_are_the_general_parse_s_or_refused():
    """/query's token ids: parsed in C straight into uint32 when every one is in range;
    any other body (negative, over 2**32 - 1, a float, a bool) goes to the general
    parse, which names the item."""
    import random

    import orjson

    import sarp.serving.http as http_mod
    from sarp import native

    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}: only the general parse runs")
    rng = random.Random(11)
    edge = ["0", "1", "4294967295", "4294967296", "-1", "-0", "18446744073709551615",
            "18446744073709551616", "1.0", "true", "01", "99999999999999999999999"]
    taken = 0
    for _ in range(2000):
        items = [rng.choice(edge) if rng.random() < 0.1 else str(rng.getrandbits(32))
                 for _ in range(rng.randint(0, 20))]
        body = ('{"token_ids": [' + rng.choice([",", ", ", " ,\n"]).join(items) + '], '
                '"model_name": "m"}').encode()
        obj = http_mod._with_fast_block_hashes(body, b"token_ids")
        if obj is None:
            continue
        taken += 1
        general = orjson.loads(body)["token_ids"]
        assert obj["token_ids"].dtype == np.uint32
        assert all(type(v) is int and 0 <= v < 1 << 32 for v in general), body
        assert obj["token_ids"].tolist() == general
    assert taken > 500


def test_a_query_s_fields_read_in_c_are_the_general_parse_s_or_left_to_it():
    """/query's one C pass (rfc.query_fields): for bodies in the shape routers send, the
    token ids, model, group and LoRA name the general parse reads; for any other body
    (an escape, another or a repeated field, a value of another type, bytes after the
    object, a cut body), None, and the general parse reads or refuses it."""
    import random

    import orjson

    from sarp import native
    from sarp.serving import rfc

    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}: only the general parse runs")
    rng = random.Random(5)
    strings = ['"llama"', '"m-1.b"', '"é ü"', '""', '"a\\"b"', '"a\\u0041"', "null", "7",
               "[]", '"tab\there"']
    taken = 0
    for _ in range(3000):
        ids = ", ".join(str(rng.getrandbits(17)) for _ in range(rng.randint(0, 12)))
        pairs = [f'"token_ids"{rng.choice(["", " "])}:{rng.choice(["", " "])}[{ids}]']
        keys = ["model_name"] + rng.sample(["routing_group", "tenant_id", "lora_name",
                                            "model_name", "other"], rng.randint(0, 3))
        for key in keys:
            value = rng.choice(strings[:4]) if rng.random() < 0.8 else rng.choice(strings)
            pairs.append(f'"{key}": {value}')
        text = "{" + rng.choice([",", ", ", " ,\n"]).join(pairs) + "}"
        if rng.random() < 0.05:
            text = text[: rng.randint(0, len(text))]
        if rng.random() < 0.05:
            text += rng.choice([" ", "x", "{}"])
        body = text.encode()
        got = rfc.query_fields(body)
        if got is None:
            continue
        taken += 1
        obj = orjson.loads(body)  # what C read, the general parse reads: a valid body
        tenant = obj.get("routing_group", obj.get("tenant_id"))
        assert (got[0].tolist(), got[1], got[2], got[3]) == (
            obj["token_ids"], obj["model_name"], tenant, obj.get("lora_name")), body
        assert set(obj) <= {"token_ids", "model_name", "routing_group", "tenant_id",
                            "lora_name"} and body.count(b'"model_name"') == 1, body
    assert taken > 1000


def test_long_arrays_read_through_bitmaps_are_the_general_parse_s_or_refused():
    """Arrays of hundreds to thousands of ids, as agentic requests send, are read from
    bitmaps of 64 bytes a word (``classify`` in http.c): numbers crossing words,
    numbers of 1 to 22 digits, every separator JSON allows, and a fault at a random
    place (a doubled or missing comma, or both, a leading zero, a sign, a fraction, a
    number past the range, a comma first or last) give the general parse's ids, or
    None."""
    import random

    import orjson

    import sarp.serving.http as http_mod
    from sarp import native

    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}: only the general parse runs")
    rng = random.Random(13)
    faults = [lambda a, i: a.insert(i, ""), lambda a, i: a.__setitem__(i, "0" + a[i]),
              lambda a, i: a.__setitem__(i, "-" + a[i]), lambda a, i: a.__setitem__(i, "1.5"),
              lambda a, i: a.__setitem__(i, "4294967296"),
              lambda a, i: a.__setitem__(i, "18446744073709551616"),
              lambda a, i: a.__setitem__(i, "1" * 22), lambda a, i: a.__setitem__(i, "0"),
              lambda a, i: a.__setitem__(i, a[i] + " " + a[i]), lambda a, i: a.insert(0, ""),
              lambda a, i: a.append(""),
              # a comma missing and another doubled: as many commas as gaps, misplaced
              lambda a, i: (a.__setitem__(i, a[i] + " " + a[i]), a.insert(i + 2, ""))]
    outcomes = {"taken": 0, "refused": 0}
    for trial in range(600):
        tokens = trial % 2 == 0
        field = "token_ids" if tokens else "block_hashes"
        top = 1 << 32 if tokens else 1 << 64  # the longest lengths kept in range
        items = [str(rng.randrange(10 ** (len(str(top)) - 1), top)) if n == len(str(top)) else
                 _digits(rng, n) for n in (rng.choice([1, 2, 5, 6, 6, 6, 8, 9, 10] if tokens
                                                      else [1, 7, 15, 16, 17, 19, 20, 20])
                                           for _ in range(rng.randint(60, 1500)))]
        if rng.random() < 0.5:
            rng.choice(faults)(items, rng.randrange(len(items)))
        seps = [",", ", ", " , ", ",\n\t", "\r,", ",  "]
        inside = "".join(item + (rng.choice(seps) if k + 1 < len(items) else "")
                         for k, item in enumerate(items))
        body = ('{"' + field + '": [' + rng.choice(["", " "]) + inside
                + rng.choice(["]}", '], "model_name": "m"}', "] }"])).encode()
        obj = http_mod._with_fast_block_hashes(body, field.encode())
        try:
            general = orjson.loads(body)[field]
        except orjson.JSONDecodeError:
            general = None
        low, high = (0, 1 << 32) if tokens else (-(1 << 63), 1 << 64)
        if obj is None:
            outcomes["refused"] += 1
            assert general is None or not all(
                type(v) is int and low <= v < high for v in general), body[:200]
            continue
        outcomes["taken"] += 1
        assert obj[field].tolist() == [v % (1 << 64) for v in general], body[:200]
    assert outcomes["taken"] > 300 and outcomes["refused"] > 100, outcomes


def test_a_query_of_hundreds_of_kb_stays_on_the_c_connection(tmp_path):
    """An agentic context's ``/query`` (a median of 176 kB in the agentic trace) is
    answered by the C connection on the event loop, where at 64 KiB it went to the
    reference and a thread hop each (1.17x slower); a body over 1 MiB goes to the
    reference, beside the loop, and gets the same answer."""
    code = f"""
import http.client, json, socket, threading
import sarp
from sarp import native
from sarp.serving import http as served, wire
from sarp.serving.workers import HttpConfig
ix, m = {str(tmp_path / "ix")!r}, {str(tmp_path / "m")!r}
with sarp.open(ix) as index:
    index.insert([1, 2], holder="e0")
served.import_for_workers(m)
server = served.make_server(sarp.open(ix, readonly=True), HttpConfig(ix, m))
import uvloop
loop = uvloop.new_event_loop()
listener = socket.create_server(("127.0.0.1", 0))
listener.setblocking(False)

def accept():
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return
    wire.take(server, loop, conn)

loop.call_soon(loop.add_reader, listener.fileno(), accept)
threading.Thread(target=loop.run_forever, daemon=True).start()
conn = http.client.HTTPConnection("127.0.0.1", listener.getsockname()[1], timeout=30)
seen = []
for tokens in (60_000, 120_000, 300_000):  # 0.4 MB, 0.8 MB and 2 MB of JSON
    body = json.dumps({{"token_ids": list(range(100_000, 100_000 + tokens)),
                       "model_name": "m"}}).encode()
    conn.request("POST", "/query", body)
    answer = conn.getresponse()
    seen.append((len(body) >> 10, answer.status, answer.read()[:40].decode(),
                 native.calls()["conn"][0]))
print(json.dumps(seen))
"""
    (tmp_path / "m").mkdir()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert [kb > 1024 for kb, *_ in seen] == [False, False, True]
    assert len({(status, text) for _, status, text, _ in seen}) == 1  # one answer
    if sarp.native.AVAILABLE:
        assert [in_c for *_, in_c in seen] == [1, 2, 2]  # the third: the reference's
