"""Which HTTP stack for serve's workers (issue 26): the same two endpoints served by
each candidate, one worker process each, loaded by wrk, passes interleaved.

* ``GET /healthz``: a 40-byte JSON answer (the stack's own cost per request);
* ``POST /query``: RFC #1403's query (token ids of a trace's request, hashed to
  token keys, matched against a real index with per-block presence, answered in
  Dynamo's shape), the same function in every stack.

Candidates: ``aiohttp`` (serve's stack since issue 15, with uvloop), ``raw`` (an
``asyncio.Protocol`` on uvloop over ``httptools``' C parser, MagicStack's, which
uvicorn uses), ``granian`` (a Rust server, hyper, calling a Python RSGI app).

The index is made once by ``sarp serve`` from simulated engines (as
``benchmarks/service.py`` does).  Run from the project root::

    .venv/bin/python benchmarks/http_stacks.py \\
        --trace ../shared/traces/mooncake_conversation.jsonl --requests 3000 --repeat 3 \\
        --json bench-results/http-stacks.json

A server alone: ``python benchmarks/http_stacks.py --serve raw --index DIR --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STACKS = ("aiohttp", "raw", "granian")
HEALTH = b'{"status":"alive","pid":%d}'


def query_handler(index_path: str):
    """``body -> (status, answer bytes)`` for ``/query``, as serve's workers answer."""
    import orjson

    import sarp
    from sarp.serving import rfc
    from sarp.serving.http import _with_fast_block_hashes, rfc_json
    from sarp.serving.status import STATUS_FILE, read_status

    index = sarp.open(index_path, readonly=True)
    models = rfc.Models(read_status, Path(index_path), STATUS_FILE)

    def handle(body: bytes) -> tuple[int, bytes]:
        try:
            obj = _with_fast_block_hashes(body, b"token_ids")
            model, keys = rfc.parse_query(orjson.loads(body) if obj is None else obj, False,
                                          models.get())
            if not keys.size:
                return 200, orjson.dumps(rfc.EMPTY)
            return 200, rfc_json(index.match(keys, with_presence=True), model)
        except (orjson.JSONDecodeError, rfc.QueryError) as exc:
            return 400, orjson.dumps({"error": str(exc)})

    return handle


def serve_aiohttp(index_path: str, port: int) -> None:
    import uvloop
    from aiohttp import web

    handle = query_handler(index_path)
    health = HEALTH % os.getpid()

    async def healthz(_):
        return web.Response(body=health, content_type="application/json")

    async def query(request):
        status, body = handle(await request.read())
        return web.Response(body=body, status=status, content_type="application/json")

    async def main():
        app = web.Application()
        app.add_routes([web.get("/healthz", healthz), web.post("/query", query)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    uvloop.run(main())


class _RawProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive over httptools: one Python call per callback, the answer
    written whole with its headers."""

    def __init__(self, handle, health: bytes) -> None:
        import httptools

        self.handle, self.health = handle, health
        self.parser = httptools.HttpRequestParser(self)
        self.error = httptools.HttpParserError
        self.url, self.body = b"", []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except self.error:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.url == b"/query":
            status, payload = self.handle(b"".join(self.body))
        elif self.url == b"/healthz":
            status, payload = 200, self.health
        else:
            status, payload = 404, b'{"error":"no such path"}'
        self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s"
                             % (status, b"OK" if status == 200 else b"-", len(payload),
                                payload))


def serve_raw(index_path: str, port: int) -> None:
    import uvloop

    handle = query_handler(index_path)
    health = HEALTH % os.getpid()

    async def main():
        loop = asyncio.get_running_loop()
        await loop.create_server(lambda: _RawProtocol(handle, health), "127.0.0.1", port)
        await asyncio.Event().wait()

    uvloop.run(main())


def _rsgi_app():
    handle = query_handler(os.environ["SARP_STACK_INDEX"])
    health = HEALTH % os.getpid()
    headers = [("content-type", "application/json")]

    async def app(scope, proto):
        if scope.path == "/query":
            status, body = handle(await proto())
        else:
            status, body = 200, health
        proto.response_bytes(status, headers, body)

    return app


def __getattr__(name: str):  # granian imports ``http_stacks:rsgi`` in its worker
    if name == "rsgi":
        globals()["rsgi"] = app = _rsgi_app()
        return app
    raise AttributeError(name)


def start(stack: str, index: Path, port: int, log) -> subprocess.Popen:
    if stack == "granian":
        env = {**os.environ, "SARP_STACK_INDEX": str(index),
               "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [str(Path(sys.executable).parent / "granian"), "--interface", "rsgi",
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--runtime-mode", "st", "--loop", "uvloop", "--no-ws", "--http", "1",
               "--log-level", "warning", "http_stacks:rsgi"]
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return subprocess.Popen([sys.executable, __file__, "--serve", stack, "--index", str(index),
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)


def build_index(args, work: Path) -> list[bytes]:
    """An index made by ``sarp serve`` from the trace's engines; returns the bodies."""
    import zmq

    sys.path.insert(0, str(HERE))
    import service as sv

    from sarp.bench import conformance as cf
    from sarp.bench.traces import read_requests

    requests = [r.hashes for _, r in zip(range(args.requests), read_requests(args.trace),
                                         strict=False)]
    stream = sv.record(requests, args.engines)
    context = zmq.Context()
    pubs = [cf.Publisher(context, name=f"e{i}", buffer_batches=len(stream) + 10)
            for i in range(args.engines)]
    service = sv.Service("sarp", work)
    try:
        service.start()
        for i, p in enumerate(pubs):
            assert cf.post(service.url, "/register", {
                "instance_id": i + 1, "endpoint": p.endpoint, "replay_endpoint":
                p.replay_endpoint, "model_name": sv.MODEL, "block_size": cf.BLOCK_SIZE,
                "dp_rank": 0})[0] == 201
        for p in pubs:
            p.wait_subscribers(1)
        markers = [cf.Engine(i + 1, 0, sv.MODEL, "vllm-0.33", pubs[i])
                   for i in range(args.engines)]
        for n, payload in stream:
            pubs[n].publish(payload)
        cf.wait_for_markers([service.url], markers, timeout_s=600)
    finally:
        service.stop()
        for p in pubs:
            p.close()
        context.term()
    return sv.queries(requests, 2000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", choices=STACKS)
    ap.add_argument("--index")
    ap.add_argument("--port", type=int)
    ap.add_argument("--trace")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--stacks", default=",".join(STACKS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.serve:
        {"aiohttp": serve_aiohttp, "raw": serve_raw}[args.serve](args.index, args.port)
        return 0
    sys.path.insert(0, str(HERE))
    import service as sv

    from sarp.bench import conformance as cf

    runs: dict[str, list[dict]] = {s: [] for s in args.stacks.split(",")}
    with tempfile.TemporaryDirectory(prefix="sarp-stacks-") as tmp:
        work = Path(tmp)
        bodies = build_index(args, work)
        for k in range(args.repeat):
            for stack in runs:
                port = sv._free_port()
                url = f"http://127.0.0.1:{port}"
                with (work / f"{stack}.log").open("a") as log:
                    proc = start(stack, work / "ix", port, log)
                try:
                    deadline = time.monotonic() + 60
                    while True:
                        try:
                            if cf.post(url, "/query", {"token_ids": [], "model_name": "llama"},
                                       timeout_s=2)[0] == 200:
                                break
                        except OSError:
                            pass
                        if proc.poll() is not None or time.monotonic() > deadline:
                            raise RuntimeError(f"{stack} did not start (see {work})")
                        time.sleep(0.05)
                    got = {f"query_{m}": v for m, v in
                           sv._wrk(url, bodies, args.seconds, work).items()}
                    got |= {f"healthz_{m}": v for m, v in
                            _wrk_get(url + "/healthz", args.seconds).items()}
                finally:
                    proc.terminate()
                    proc.wait(10)
                runs[stack].append(got)
                print(f"pass {k + 1} {stack}: " + ", ".join(
                    f"{m} {v:,.2f}" for m, v in got.items()), flush=True)
    out = {"trace": args.trace, "requests": args.requests, "runs": runs, "median": {}}
    for metric in next(iter(runs.values()))[0]:
        out["median"][metric] = {s: statistics.median(r[metric] for r in rs)
                                 for s, rs in runs.items()}
        print(f"{metric}: " + ", ".join(
            f"{s} {out['median'][metric][s]:,.2f} ({min(r[metric] for r in rs):,.2f}-"
            f"{max(r[metric] for r in rs):,.2f})" for s, rs in runs.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def _wrk_get(url: str, seconds: float, clients: int = 8) -> dict:
    out = subprocess.run(["wrk", "-t2", f"-c{clients}", f"-d{seconds:g}s", "--latency", url],
                         capture_output=True, text=True, check=True).stdout
    rate = float(next(ln for ln in out.splitlines() if ln.startswith("Requests/sec")).split()[1])
    pct = {}
    for ln in out.splitlines():
        parts = ln.split()
        if len(parts) == 2 and parts[0] in ("50%", "99%"):
            v = parts[1]
            pct[parts[0]] = float(v[:-2]) / 1000 if v.endswith("us") else \
                float(v[:-2]) if v.endswith("ms") else float(v[:-1]) * 1000
    return {"requests_per_s": rate, "p50_ms": pct["50%"], "p99_ms": pct["99%"]}


if __name__ == "__main__":
    raise SystemExit(main())
