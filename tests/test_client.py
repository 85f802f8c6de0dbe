"""``sarp.client`` and ``GET /openapi.json`` against a real ``sarp serve --http`` fed by
a simulated engine on loopback: the document validates as OpenAPI 3.1, every answer
fits its schema, and the sync and asyncio clients answer exactly what raw HTTP does,
on one kept-alive connection made again after the server closed it."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import zmq
from servekit import Serve, call

from sarp.bench import conformance as cf
from sarp.client import AsyncClient, Client, ServiceError
from sarp.tokenkeys import token_keys

MODEL = "llama"


def _schema_check(document: dict):
    """A function (path, method, status, answer) that validates ``answer`` against
    the document's schema for it (``$ref`` resolved within the document)."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    registry = Registry().with_resource(
        "urn:sarp", Resource.from_contents(document, default_specification=DRAFT202012))

    def check(path: str, method: str, status: int, answer) -> None:
        pointer = "/".join(p.replace("~", "~0").replace("/", "~1") for p in (
            "paths", path, method, "responses", str(status), "content",
            "text/plain" if path == "/metrics" else "application/json", "schema"))
        Draft202012Validator({"$ref": f"urn:sarp#/{pointer}"}, registry=registry).validate(
            answer)

    return check


def _raw(port: int, method: str, path: str, body=None):
    return call(port, method, path, None if body is None else json.dumps(body).encode())


def test_the_clients_answer_what_raw_http_answers_and_the_document_describes(tmp_path):
    from openapi_spec_validator import validate

    context = zmq.Context()
    pub = cf.Publisher(context, name="e1")
    engine = cf.Engine(1, 0, MODEL, "vllm-0.33", pub)
    ids = np.arange(1, 9, dtype=np.uint64)
    tokens = cf.block_tokens(ids).tolist() + [5, 6, 7]  # and a partial block
    local = token_keys(tokens, cf.BLOCK_SIZE, parent=0)[1].astype(np.int64).tolist()
    registration = {"instance_id": 1, "endpoint": pub.endpoint,
                    "replay_endpoint": pub.replay_endpoint, "model_name": MODEL,
                    "block_size": cf.BLOCK_SIZE, "dp_rank": 0}
    try:
        with Serve(tmp_path / "ix", [], workers=1, log=tmp_path / "serve.log") as serve:
            serve.wait_ready()
            port, url = serve.port, f"http://127.0.0.1:{serve.port}"
            with Client(url) as c:
                document = c.openapi()
                validate(document)  # OpenAPI 3.1, with its JSON Schemas
                check = _schema_check(document)
                assert document == _raw(port, "GET", "/openapi.json")[1]
                got = c.register(1, pub.endpoint, replay_endpoint=pub.replay_endpoint,
                                 model_name=MODEL, block_size=cf.BLOCK_SIZE, dp_rank=0)
                assert (201, got) == _raw(port, "POST", "/register", registration)
                check("/register", "post", 201, got)
                engine.serve(ids)
                def held() -> bool:  # 404 until the status file names the model
                    try:
                        return "1" in c.query(tokens, MODEL)["scores"]
                    except ServiceError:
                        return False

                serve.wait_for(held, what="the engine's blocks")
                sock = c._conn.sock.getsockname()
                asked = {
                    ("/query", "post", 200): (lambda: c.query(tokens, MODEL),
                                              {"token_ids": tokens, "model_name": MODEL}),
                    ("/query_by_hash", "post", 200): (
                        lambda: c.query_by_hash(local, MODEL),
                        {"block_hashes": local, "model_name": MODEL}),
                    ("/v1/match", "post", 200): (
                        lambda: c.match(token_ids=tokens, block_size=cf.BLOCK_SIZE),
                        {"token_ids": tokens, "block_size": cf.BLOCK_SIZE}),
                    ("/workers", "get", 200): (c.workers, None),
                    ("/healthz", "get", 200): (c.healthz, None),
                    ("/readyz", "get", 200): (c.readyz, None),
                }
                for (path, method, status), (ask, body) in asked.items():
                    got = ask()
                    assert (status, got) == _raw(port, method.upper(), path, body), path
                    check(path, method, status, got)
                assert c.query(tokens, MODEL)["instances"]["1"]["gpu"] == 8 * cf.BLOCK_SIZE
                many = c.match_many([[1, 2], [3]])
                assert many == _raw(port, "POST", "/v1/match",
                                    {"requests": [[1, 2], [3]]})[1]["results"]
                assert c.metrics().startswith("# HELP")
                assert c._conn.sock.getsockname() == sock  # one connection throughout
                with pytest.raises(ServiceError) as refused:
                    c.query(tokens, "no-such-model")
                status, body = _raw(port, "POST", "/query",
                                    {"token_ids": tokens, "model_name": "no-such-model"})
                assert (refused.value.status, refused.value.field, refused.value.message) == (
                    status, body["field"], body["error"]) and status == 404
                check("/query", "post", 404, body)
                with pytest.raises(ServiceError, match="block_size"):
                    c.register(2, pub.endpoint, model_name=MODEL, block_size=0)

            async def the_same_with_asyncio() -> list:
                async with AsyncClient(url) as a:
                    out = [await a.query(tokens, MODEL), await a.query_by_hash(local, MODEL),
                           await a.match(token_ids=tokens, block_size=cf.BLOCK_SIZE),
                           await a.workers(), await a.readyz(), await a.openapi()]
                    sock = a._writer.get_extra_info("sockname")
                    out += await asyncio.gather(*(a.query(tokens, MODEL) for _ in range(5)))
                    assert a._writer.get_extra_info("sockname") == sock
                    with pytest.raises(ServiceError) as refused:
                        await a.query(tokens, "no-such-model")
                    assert refused.value.status == 404
                    return out

            with Client(url) as c:
                expected = [c.query(tokens, MODEL), c.query_by_hash(local, MODEL),
                            c.match(token_ids=tokens, block_size=cf.BLOCK_SIZE),
                            c.workers(), c.readyz(), c.openapi()]
            assert asyncio.run(the_same_with_asyncio()) == expected + [expected[0]] * 5
            with Client(url) as c:
                assert c.unregister(1)["removed"] == ["1#0"]
                with pytest.raises(ServiceError) as gone:
                    c.unregister(1)
                assert gone.value.status == 404 and gone.value.field == "instance_id"
    finally:
        pub.close()
        context.term()


def test_a_client_makes_its_connection_again_after_the_server_closed_it(tmp_path):
    with Serve(tmp_path / "ix", [], "--http-idle-timeout-s", "0.5", workers=1) as serve:
        serve.wait_for(lambda: call(serve.port, "GET", "/healthz")[0] == 200,
                       what="/healthz")
        url = f"http://127.0.0.1:{serve.port}"
        with Client(url) as c:
            first = c.healthz()
            time.sleep(1.5)  # the server closes the idle connection
            assert c.healthz() == first

        async def twice() -> tuple:
            async with AsyncClient(url) as a:
                one = await a.healthz()
                await asyncio.sleep(1.5)
                return one, await a.healthz()

        one, two = asyncio.run(twice())
        assert one == two == first


def test_a_client_refuses_a_url_it_cannot_use():
    for url, named in (("https://127.0.0.1:8080", "TLS"), ("127.0.0.1:8080", "http://")):
        with pytest.raises(ValueError, match=named):
            Client(url)
    with pytest.raises(ValueError, match="block_hashes or token_ids"):
        Client().match()
