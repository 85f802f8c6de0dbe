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
            assert post(serve.port, "/register", body) == (200, {
                "status": "registered", "instance_id": 7, "dp_rank": 0})
            serve.wait_for(lambda: held_by(serve.port, ca, "7#0") == len(ca),
                           what="the registered engine, replayed")
            listed_7 = {"instance_id": 7, "endpoints": {"0": first.publisher.endpoint}}
            serve.wait_for(lambda: listed_7 in call(serve.port, "GET", "/workers")[1],
                           what="/workers listing it (the status is written every 0.5 s)")
            assert {"instance_id": 8, "endpoints": {"0": other.publisher.endpoint}} in call(
                serve.port, "GET", "/workers")[1]
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
                        headers={"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        first.publisher.close()
        other.publisher.close()
