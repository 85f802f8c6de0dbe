"""sarp serve against Dynamo's standalone indexer (``python -m dynamo.indexer`` from the
ai-dynamo-runtime 1.6.1 wheel, installed by ``make test`` into ``.venv-dynamo``), fed
by the same engines (real ZeroMQ sockets on loopback, real processes): the same
``/query`` and ``/query_by_hash`` requests, drawn from the Mooncake and agentic traces,
get the same answers per instance, tier and DP rank; and ``/unregister`` takes an
engine out of both."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import trace_path
from servekit import Serve, free_port

from sarp.bench import conformance as cf
from sarp.bench.traces import read_requests

ROOT = Path(__file__).resolve().parents[1]
DYNAMO_VENV = ROOT / ".venv-dynamo"


def dynamo_python() -> str:
    """The Python with ai-dynamo-runtime 1.6.1, or a skip saying why there is none."""
    python = os.environ.get("SARP_DYNAMO_PYTHON")
    if python is None and (DYNAMO_VENV / ".installed").exists():
        python = str(DYNAMO_VENV / "bin" / "python")
    if python is not None and Path(python).exists():
        return python
    why = (DYNAMO_VENV / "FAILED").read_text().strip() if (DYNAMO_VENV / "FAILED").exists() \
        else "make test installs it (make dynamo)"
    pytest.skip(f"no ai-dynamo-runtime 1.6.1 in {DYNAMO_VENV}: {why}")


@pytest.fixture
def dynamo(tmp_path):
    port = free_port()
    log = (tmp_path / "dynamo.log").open("w")
    proc = subprocess.Popen([dynamo_python(), "-m", "dynamo.indexer", "--port", str(port),
                             "--threads", "4"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if cf.post(url, "/query", {"token_ids": [], "model_name": "x"})[0] == 404:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "dynamo.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "Dynamo's indexer did not answer in 30 s"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _requests(name: str, count: int, offset: int = 0) -> list[np.ndarray]:
    """A trace's first requests; ``offset`` keeps two traces' block ids apart (each
    trace's ids name their prefix, as engines' hashes do, but both count from 0)."""
    return [r.hashes + np.uint64(offset)
            for _, r in zip(range(count), read_requests(trace_path(name)), strict=False)]


def test_sarp_answers_every_rfc_query_as_dynamos_indexer_does(tmp_path, dynamo):
    chat = _requests("mooncake_conversation.jsonl", 700)
    agentic = _requests("weka_claude_code_dev.jsonl.gz", 300, offset=1 << 40)
    context = zmq.Context()
    engines = cf.engines(context)
    try:
        with Serve(tmp_path / "ix", []) as serve:
            serve.wait_ready()
            sarp_url = f"http://127.0.0.1:{serve.port}"
            for body in cf.registrations(engines):
                assert cf.post(sarp_url, "/register", body)[0] == 201
                assert cf.post(dynamo, "/register", body)[0] == 201
            for e in engines:
                e.publisher.wait_subscribers(2)  # sarp's and Dynamo's
            cf.drive(engines, chat + agentic)
            cf.wait_for_markers([sarp_url, dynamo], engines)
            asked = cf.queries(chat, 1200, seed=3) + cf.queries(agentic, 900, seed=4)
            differences, counts = cf.compare(sarp_url, dynamo, asked)
            assert counts["asked"] == 2100 and counts["with_hits"] > 1000, counts
            assert counts["not_found"] > 0  # a model nobody serves: 404 from both
            assert counts["other_model"] == 0  # a model's query names only its engines
            assert differences == [], (len(differences), differences[:3])

            # an engine unregistered: gone from both services' answers
            for url in (sarp_url, dynamo):
                assert cf.post(url, "/unregister", {"instance_id": 1,
                                                    "model_name": "llama"})[0] == 200
            again = [q for q in asked if q[1]["model_name"] == "llama"][:400]
            deadline = time.monotonic() + 30
            while True:
                differences, _ = cf.compare(sarp_url, dynamo, again)
                named = [q for q in again if "1" in (cf.post(sarp_url, *q)[1] or {}).get(
                    "instances", {})]
                if not differences and not named:
                    break
                assert time.monotonic() < deadline, (len(differences), differences[:2],
                                                     len(named))
                time.sleep(0.5)
    finally:
        for e in engines:
            e.publisher.close()
        context.term()


def test_http_on_serve_s_own_thread_answers_as_its_workers_do_while_engines_publish(tmp_path):
    """``--http-workers 0`` (HTTP on a thread of serve's own, matching on the writer's
    memory between its commits) against a serve with a worker process, fed by the same
    engines: while they publish, 4 clients asking the thread get every answer (none
    refused, none failed); once both have applied everything, every ``/query`` and
    ``/query_by_hash`` gets the same answer from both."""
    import threading

    chat = _requests("mooncake_conversation.jsonl", 500)
    asked = cf.queries(chat, 600, seed=5)
    context = zmq.Context()
    engines = cf.engines(context)
    try:
        with Serve(tmp_path / "own", [], workers=0) as own, \
                Serve(tmp_path / "ix", [], workers=1) as worker:
            urls = [f"http://127.0.0.1:{s.port}" for s in (own, worker)]
            for s in (own, worker):
                s.wait_ready()
            for url in urls:
                for body in cf.registrations(engines):
                    assert cf.post(url, "/register", body)[0] == 201
            for e in engines:
                e.publisher.wait_subscribers(2)
            statuses: list[int] = []
            stop = threading.Event()

            def client(k: int) -> None:
                mine = asked[k::4]
                while not stop.is_set():
                    for path, body in mine:
                        statuses.append(cf.post(urls[0], path, body)[0])
                        if stop.is_set():
                            break

            clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
            for c in clients:
                c.start()
            try:
                cf.drive(engines, chat)
                cf.wait_for_markers(urls, engines)
            finally:
                stop.set()
                for c in clients:
                    c.join(60)
            assert len(statuses) > 100 and set(statuses) <= {200, 404}, sorted(set(statuses))
            differences, counts = cf.compare(urls[0], urls[1], asked)
            assert counts["with_hits"] > 200, counts
            assert differences == [], (len(differences), differences[:2])
    finally:
        for e in engines:
            e.publisher.close()
        context.term()
