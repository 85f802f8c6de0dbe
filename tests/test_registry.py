"""Engines that come and go at runtime (issue 25, item 1): real ZeroMQ sockets on
loopback and simulated engines with real LRU caches.  An engine added while serve runs
has its history replayed from its buffer as at start-up, without stalling the others;
an engine removed is cleared, and the index claims nothing of it after."""

from __future__ import annotations

import json
import time

import pytest
from test_subscriber import chains, engine, held, settle, wait_applied

import sarp
from sarp.serving.sources import STATE_FILE
from sarp.serving.subscriber import Source, Subscriber


def connected(sub: Subscriber, key: str, timeout_s: float = 10.0) -> None:
    """Poll until ``key``'s SUB socket has connected, and a little more for its
    subscription to reach the engine: a PUB socket drops what it sends before then (a
    slow CI run saw all 20 of a's batches go that way, and nothing came after them)."""
    deadline = time.monotonic() + timeout_s
    while sub._connects[key] < 1 and time.monotonic() < deadline:
        sub.poll(10)
    for _ in range(20):
        sub.poll(10)


def source_of(eng) -> Source:
    return Source(eng.name, eng.publisher.endpoint, eng.publisher.replay_endpoint)


@pytest.fixture
def index(tmp_path):
    with sarp.open(tmp_path / "ix", durability="nosync") as ix:
        yield ix


def test_an_engine_added_at_runtime_is_replayed_and_one_removed_is_cleared(index):
    a, b = engine("a"), engine("b")
    try:
        sub = Subscriber(index, [source_of(a)])
        settle(sub)
        connected(sub, "a")
        work, other = chains(3, 40), chains(4, 20)
        for chain, its in zip(work[:20], other, strict=True):
            a.serve(chain)
            b.serve(its)  # b serves before anyone follows it
        wait_applied(sub, "a", a.publisher)
        assert held(index, b.holder) == set()
        sub.add_source(source_of(b))  # its buffer is asked, as at start-up
        for chain in work[20:]:
            a.serve(chain)  # a goes on meanwhile
        settle(sub)
        wait_applied(sub, "a", a.publisher)
        wait_applied(sub, "b", b.publisher)
        assert held(index, a.holder) == set(a.cache)
        assert held(index, b.holder) == set(b.cache) != set()
        with pytest.raises(ValueError, match="followed already"):
            sub.add_source(source_of(b))
        sub.remove_source("b")
        assert held(index, b.holder) == set()  # the engine left: nothing claimed of it
        b.serve(other[0])
        for _ in range(20):
            sub.poll(10)
        assert held(index, b.holder) == set()  # not followed any more
        assert held(index, a.holder) == set(a.cache)
        assert "b" not in json.loads(index.read_state(STATE_FILE))["sources"]
        with pytest.raises(KeyError):
            sub.remove_source("b")
        sub.add_source(source_of(b))  # back: rebuilt from its buffer
        settle(sub)
        wait_applied(sub, "b", b.publisher)
        assert held(index, b.holder) == set(b.cache)
        sub.close()
    finally:
        a.publisher.close()
        b.publisher.close()


def test_serve_follows_its_sources_file_and_a_restart_keeps_the_engines(tmp_path):
    from servekit import Serve, call, match

    def held_by(port: int, hashes: list[int], instance: str) -> int:
        status, body = match(port, {"block_hashes": hashes})
        assert status == 200, body
        return next((s["matched_blocks"] for s in body["instances"]
                     if s["instance"] == instance), 0)

    def spec(eng) -> str:
        return f"{eng.name}={eng.publisher.endpoint},{eng.publisher.replay_endpoint}"

    a, b = engine("a"), engine("b")
    listed = tmp_path / "engines.yaml"
    listed.write_text(f"engines:\n  - {spec(a)}\n")
    ca, cb = chains(5, 1)[0], chains(6, 1)[0]
    try:
        a.serve(ca)
        b.serve(cb)
        with Serve(tmp_path / "ix", [], "--sources-file", str(listed)) as serve:
            serve.wait_ready()
            serve.wait_for(lambda: held_by(serve.port, ca, "a#0") == len(ca), what="a")
            assert held_by(serve.port, cb, "b#0") == 0
            listed.write_text(f"engines:\n  - {spec(a)}\n  - name: b\n"
                              f"    endpoint: {b.publisher.endpoint}\n"
                              f"    replay_endpoint: {b.publisher.replay_endpoint}\n")
            serve.wait_for(lambda: held_by(serve.port, cb, "b#0") == len(cb),
                           what="b, added to the file (its buffer replayed)")
            listed.write_text(f"[{json.dumps(spec(b))}]\n")  # JSON too; a is gone
            serve.wait_for(lambda: held_by(serve.port, ca, "a#0") == 0,
                           what="a, dropped from the file, cleared")
            listed.write_text("engines: [not an engine")  # a bad edit changes nothing
            time.sleep(2.5)
            assert serve.alive() and held_by(serve.port, cb, "b#0") == len(cb)
        # started again without naming engines: it follows those the last serve followed
        with Serve(tmp_path / "ix", []) as again:
            again.wait_ready()
            b.serve(cb + [77, 78])
            again.wait_for(lambda: held_by(again.port, cb + [77, 78], "b#0") == len(cb) + 2,
                           what="b, followed after the restart")
            assert call(again.port, "GET", "/readyz")[0] == 200
    finally:
        a.publisher.close()
        b.publisher.close()


def test_serve_without_engines_says_how_to_name_them(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sarp.cli", "serve", "--index",
                          str(tmp_path / "ix")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--sources-file" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "ix").exists()  # refused before anything was made


def test_register_unregister_and_workers_in_the_indexers_shapes(tmp_path):
    """The shapes of Dynamo's standalone indexer (Mooncake RFC #1403): an engine
    registered at runtime is followed (its buffer replayed), listed by /workers, and
    unregistering clears it; a restart keeps the registrations; a bad body is a 400
    naming the field, and with a token the admin endpoints ask for it."""
    from servekit import Serve, call, match

    def post(port: int, path: str, obj, headers=None):
        return call(port, "POST", path, json.dumps(obj).encode(), headers=headers)

    def held_by(port: int, hashes: list[int], instance: str) -> int:
        status, body = match(port, {"block_hashes": hashes})
        assert status == 200, body
        return next((s["matched_blocks"] for s in body["instances"]
                     if s["instance"] == instance), 0)

    first, other = engine("7"), engine("8")
    ca, cb = chains(8, 1)[0], chains(9, 1)[0]
    listed = tmp_path / "engines.yaml"
    listed.write_text(f"- 8={other.publisher.endpoint},{other.publisher.replay_endpoint}\n")
    try:
        first.serve(ca)
        other.serve(cb)
        with Serve(tmp_path / "ix", [], "--sources-file", str(listed)) as serve:
            serve.wait_ready()
            body = {"instance_id": 7, "endpoint": first.publisher.endpoint,
                    "replay_endpoint": first.publisher.replay_endpoint, "dp_rank": 0}
            assert post(serve.port, "/register", body) == (201, {
                "status": "ok", "instance_id": 7, "dp_rank": 0})  # Dynamo's 201
            serve.wait_for(lambda: held_by(serve.port, ca, "7#0") == len(ca),
                           what="the registered engine, replayed")
            def worker(iid: int) -> dict | None:
                return next((w for w in call(serve.port, "GET", "/workers")[1]
                             if w["instance_id"] == iid), None)

            serve.wait_for(lambda: worker(7) is not None,
                           what="/workers listing it (the status is written every 0.5 s)")
            assert worker(7)["endpoints"] == {"0": first.publisher.endpoint}
            assert worker(8)["endpoints"] == {"0": other.publisher.endpoint}
            assert worker(8)["model_name"] is None  # keyed by its engine's hashes
            assert post(serve.port, "/register", {"instance_id": 7})[0] == 400
            assert post(serve.port, "/register", {"instance_id": 7, "endpoint": "10.0.0.5"})[1][
                "field"] == "endpoint"
            assert post(serve.port, "/unregister", {"instance_id": 99})[0] == 404
            time.sleep(1.5)  # the sources file's engine stays: /register is not the file's
            assert held_by(serve.port, cb, "8#0") == len(cb)
        with Serve(tmp_path / "ix", [], "--sources-file", str(listed)) as again:
            again.wait_ready()  # the registration was kept with the index: 7 is followed
            first.serve(ca + [91, 92])
            again.wait_for(lambda: held_by(again.port, ca + [91, 92], "7#0") == len(ca) + 2,
                           what="7's new store, after the restart")
            assert post(again.port, "/unregister", {"instance_id": 7})[0] == 200
            assert held_by(again.port, ca + [91, 92], "7#0") == 0  # cleared as it went
            again.wait_for(lambda: all(w["instance_id"] != 7 for w in
                                       call(again.port, "GET", "/workers")[1]),
                           what="/workers without it")
        token = tmp_path / "token"
        token.write_text("s3cret\n")
        with Serve(tmp_path / "ix", [], "--sources-file", str(listed), "--http-token-file",
                   str(token)) as guarded:
            guarded.wait_ready()
            body = {"instance_id": 7, "endpoint": first.publisher.endpoint}
            assert post(guarded.port, "/register", body)[0] == 401
            assert post(guarded.port, "/register", body,
                        headers={"Authorization": "Bearer s3cret"})[0] == 201
    finally:
        first.publisher.close()
        other.publisher.close()


def test_a_sources_file_entry_with_a_model_has_its_blocks_keyed_by_tokens(tmp_path):
    from sarp.serving.sources import read_sources_file
    from sarp.tokenkeys import model_root

    f = tmp_path / "engines.yaml"
    f.write_text("- {name: '7', endpoint: 'tcp://10.0.0.5:5557', model_name: llama,\n"
                 "   block_size: 16, routing_group: team-a, dp_ranks: 2}\n"
                 "- w1=tcp://10.0.0.6:5557\n")
    ranked, plain = read_sources_file(f)[:2], read_sources_file(f)[2]
    assert [(s.key, s.model, s.tenant, s.block_size) for s in ranked] == [
        ("7#0", "llama", "team-a", 16), ("7#1", "llama", "team-a", 16)]
    assert ranked[0].root == model_root("llama", "team-a") and plain.root is None
    f.write_text("- {name: '7', endpoint: 'tcp://10.0.0.5:5557', model_name: llama}\n")
    with pytest.raises(ValueError, match="block_size=None"):
        read_sources_file(f)


def test_rfc_queries_and_registrations_refuse_bad_input_naming_the_field(tmp_path):
    from servekit import Serve, call

    def post(port: int, path: str, obj):
        return call(port, "POST", path, json.dumps(obj).encode())

    with Serve(tmp_path / "ix", []) as serve:  # no engine named: it waits for /register
        serve.wait_ready()
        port = serve.port
        assert post(port, "/query", {"token_ids": [1], "model_name": "llama"})[0] == 404
        bad = {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5557", "model_name": "llama"}
        assert post(port, "/register", bad)[1]["field"] == "block_size"
        assert post(port, "/register", {**bad, "block_size": 16})[0] == 201
        # a second block size for the model is refused, and changes nothing
        other = {**bad, "instance_id": 2, "block_size": 32}
        status, body = post(port, "/register", other)
        assert status == 409 and body["field"] == "block_size"
        serve.wait_for(lambda: post(port, "/query", {"token_ids": [],
                                                     "model_name": "llama"})[0] == 200,
                       what="the model known to the workers")
        for body, field in (({"token_ids": [-1], "model_name": "llama"}, "token_ids[0]"),
                            ({"token_ids": [5, True], "model_name": "llama"}, "token_ids[1]"),
                            ({"token_ids": [5, 1.5], "model_name": "llama"}, "token_ids[1]"),
                            ({"token_ids": "12", "model_name": "llama"}, "token_ids"),
                            ({"token_ids": [1]}, "model_name"),
                            ({"token_ids": [1], "model_name": "llama", "lora_name": 3},
                             "lora_name"),
                            ([1, 2], "body")):
            status, got = post(port, "/query", body)
            assert (status, got["field"]) == (400, field), got
        assert post(port, "/query_by_hash", {"block_hashes": [1.5],
                                             "model_name": "llama"})[1]["field"] == \
            "block_hashes"
        workers = call(port, "GET", "/workers")[1]
        assert [(w["instance_id"], w["model_name"], w["block_size"]) for w in workers] == [
            (1, "llama", 16)]


def test_registrations_with_a_model_are_kept_with_the_index(tmp_path):
    from sarp.serving.sources import load_sources, save_sources

    kept = [Source("7", "tcp://10.0.0.5:5557", None, 1, "llama", "team-a", 16),
            Source("w1", "tcp://10.0.0.6:5557")]
    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        save_sources(index, kept, {"7#1"})
    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        assert load_sources(index) == [(kept[0], True), (kept[1], False)]


def test_source_engines_of_a_model_answer_rfc_queries(tmp_path):
    """``--source`` engines with ``--model-name`` (as Dynamo's indexer takes
    ``--workers`` with ``--model-name``) are keyed by their tokens: a router asks
    ``/query`` with nothing but tokens."""
    from servekit import Serve, call

    from sarp.serving.events import _tokens_of

    eng = engine("7")
    work = chains(12, 3)
    try:
        for chain in work:
            eng.serve(chain)
        spec = f"7={eng.publisher.endpoint},{eng.publisher.replay_endpoint}"
        out = Serve(tmp_path / "refused", [spec], "--model-name", "llama")
        assert out.proc.wait(60) == 2 and not (tmp_path / "refused").exists()
        with Serve(tmp_path / "ix", [spec], "--model-name", "llama", "--block-size",
                   "16") as serve:
            serve.wait_ready()
            body = json.dumps({"token_ids": _tokens_of(work[0]) + [5, 6],
                               "model_name": "llama"}).encode()
            serve.wait_for(lambda: call(serve.port, "POST", "/query", body)[1]["scores"]
                           == {"7": {"0": 16 * len(work[0])}}, what="the engine's blocks")
            # the same answer from the worker's C connection (a keep-alive request in
            # routers' shape) and from the reference (one that asks to close)
            closing = {"Content-Type": "application/json", "Connection": "close"}
            for asked in (body, json.dumps({"token_ids": _tokens_of(work[1]),
                                            "model_name": "llama"}).encode()):
                assert call(serve.port, "POST", "/query", asked) == call(
                    serve.port, "POST", "/query", asked, headers=closing)
            # a worker's /query answers reach sarp_matches_total read from the other
            # worker (each folds its count every 0.1 s)
            one, other = _two_workers(serve.port)
            before = _matches_total(other)
            for _ in range(5):
                one.request("POST", "/query", body)
                assert one.getresponse().read().startswith(b'{"scores"')
            serve.wait_for(lambda: _matches_total(other) >= before + 5, timeout_s=5,
                           what="the other worker's /query answers counted in /metrics")
            other = json.dumps({"token_ids": _tokens_of(work[0]), "model_name": "qwen"})
            assert call(serve.port, "POST", "/query", other.encode())[0] == 404
    finally:
        eng.publisher.close()


def test_the_model_table_is_read_again_at_most_every_interval_and_at_once_for_a_new_model(
        tmp_path):
    """/query's model table (rfc.Models): the status file is looked at again only after
    ``check_every_s``; a model it does not hold is looked for in the file at once, so
    an engine registered a moment ago is never answered 404."""
    from sarp.serving import rfc
    from sarp.serving.status import STATUS_FILE, read_status

    def write(*models: str) -> None:
        engines = [{"name": str(i), "model": m, "block_size": 16} for i, m in enumerate(models)]
        tmp = tmp_path / "status.tmp"
        tmp.write_text(json.dumps({"engines": engines}))
        tmp.replace(tmp_path / STATUS_FILE)  # as the writer replaces it

    write("llama")
    table = rfc.Models(read_status, tmp_path, STATUS_FILE, check_every_s=3600)
    assert [m for m, _ in table.get()] == ["llama"]
    write("llama", "qwen")
    assert [m for m, _ in table.get()] == ["llama"]  # within the interval: not looked at
    assert sorted(m for m, _ in table.get(fresh=True)) == ["llama", "qwen"]
    write("qwen")
    always = rfc.Models(read_status, tmp_path, STATUS_FILE, check_every_s=0)
    assert [m for m, _ in always.get()] == ["qwen"]
    write("llama")
    assert [m for m, _ in always.get()] == ["llama"]


def _two_workers(port: int) -> tuple:
    """Two keep-alive connections that serve's dealer gave to different workers."""
    import http.client

    def opened() -> tuple:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/healthz")
        return conn, json.loads(conn.getresponse().read())["pid"]

    first, pid = opened()
    for _ in range(10):
        conn, other = opened()
        if other != pid:
            return first, conn
    raise AssertionError("the dealer gave 10 connections in a row to one worker")


def _matches_total(conn) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "sarp_matches_total")


def test_a_restart_is_never_ready_from_the_status_a_killed_serve_left(tmp_path):
    """The workers start, and answer, before serve has checked the engines: the status
    file a killed serve left (caught up, its heartbeat fresh) must never make them
    ready, and `/workers` lists the engines from the first answer."""
    import zmq
    from servekit import Serve, call

    from sarp.serving.status import STATUS_FILE

    ctx = zmq.Context.instance()
    pub, replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)  # the replay never answers
    spec = (f"eng=tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')},"
            f"tcp://127.0.0.1:{replay.bind_to_random_port('tcp://127.0.0.1')}")
    ix = tmp_path / "ix"
    try:
        with Serve(ix, [spec]) as first:
            first.wait_for(lambda: call(first.port, "GET", "/healthz")[0] == 200, what="up")
        left = json.loads((ix / STATUS_FILE).read_text())
        (ix / STATUS_FILE).write_text(json.dumps(left | {"caught_up": True,
                                                         "heartbeat": time.time() + 60}))
        with Serve(ix, [spec], "--replay-idle-timeout-s", "30") as again:
            answers = []
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                try:
                    answers.append(call(again.port, "GET", "/readyz", timeout_s=2))
                    if len(answers) == 1:
                        listed = call(again.port, "GET", "/workers")[1]
                except OSError:
                    time.sleep(0.002)  # not listening yet
            assert answers and {s for s, _ in answers} == {503}, answers[:3]
            assert not any(body["ready"] or body["caught_up"] for _, body in answers)
            assert [w["instance_id"] for w in listed] == ["eng"]
    finally:
        pub.close(0)
        replay.close(0)
