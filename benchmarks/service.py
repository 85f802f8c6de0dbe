"""``sarp serve`` against Dynamo's standalone indexer as services (issue 26), on the
same simulated engines and the same requests, one service at a time, passes
interleaved (sarp, Dynamo, sarp, Dynamo, ...).

The engines are :mod:`sarp.bench.conformance`'s (vLLM events with token ids, block
size 16, GPU caches with CPU offload), 8 instances of one model; their stream is
recorded once from the trace's requests and replayed in every pass.  Per pass, on a
fresh service:

1. **backlog drain**: the engines registered (each service subscribed), the whole
   stream published as fast as the engines can send it, timed to the moment the
   service answers every engine's last batch (a marker block); and, on another fresh
   service, the **queued drain**: the same stream published while the service's
   processes are stopped, timed from the moment they go on (:func:`queued_drain`);
2. **HTTP**: 8 asyncio clients on keep-alive connections send ``/query`` for
   ``--http-s`` seconds (requests drawn from the trace; an ``asyncio.Protocol`` with
   httptools, light enough that the service, not the client, sets the rate),
   requests/s and latency p50/p99; then the same with wrk (a C load generator, 2
   threads, 8 connections), where it is installed (Debian's ``wrk``);
   The CPU the service's process tree used in the drain and under wrk is read too:
   the cores it kept busy, and CPU µs per event and per request (and wrk's own CPU
   per request: the machine is shared, so it bounds what any service's rate can be);
3. **RSS, PSS and anonymous RSS**: of the service's process tree, the moment the drain
   ends and again ``SETTLE_S`` later (``*_settled_mib``: what it holds once idle);
4. **kill -9 to correct answers**: the service SIGKILLed and started again (Dynamo
   keeps no registrations: they are sent again; sarp keeps them with its index), each
   engine then publishes one more batch, and the time is taken until 50 sampled
   requests get the answers they had before the kill;
5. **rate sweep** (``--rates``, on a fresh service): the stream published at each
   offered rate for ``--rate-s`` seconds, with a probe every 50 ms (a new block on the
   next engine, in order with its stream) timed until the service answers it; the
   highest rate held is the highest whose probe lag p99 is at most 100 ms, of those
   the engines reached (95% of it published: they share the 2 cores).

Run it from the project root (Dynamo from ``make dynamo``'s ``.venv-dynamo``)::

    .venv/bin/python benchmarks/service.py --trace ../shared/traces/mooncake_conversation.jsonl \\
        --requests 3000 --repeat 3 --json bench-results/service-mooncake.json \\
        --plot bench-results/service-mooncake.png

(``--replot JSON --plot PNG`` draws an earlier run's JSON again, its rate held scored
again by :func:`held` and written back.  ``--sarp-valkey``
puts sarp's index in a namespace of a Valkey server the run starts, for serve on
Valkey; its restart then waits for the killed writer's lease to run out.)
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import zmq

import sarp
from sarp.bench import conformance as cf
from sarp.bench.traces import read_requests
from sarp.serving.events import decode

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama"
QUEUE_SETTLE_S = 0.2  # the queued drain: publishing ends, this, then the service goes on
VALKEY = None  # --sarp-valkey: the server sarp's indexes are namespaces of
SARP_HTTP_WORKERS: int | None = None  # --sarp-http-workers (None: serve's default)


class _Tape:
    """A publisher that records what an engine publishes (the stream, once)."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, payload: bytes) -> int:
        self.payloads.append(payload)
        return len(self.payloads)


def record(requests: list[np.ndarray], engines: int, seed: int = 1) -> list[tuple[int, bytes]]:
    """The engines' stream, as ``(engine, payload)`` in publish order."""
    order: list[tuple[int, bytes]] = []
    tapes = [_Tape() for _ in range(engines)]
    sims = [cf.Engine(i + 1, 0, MODEL, ("vllm-0.33", "vllm-0.11")[i % 2], tapes[i],
                      gpu_blocks=10_000, cpu_blocks=20_000) for i in range(engines)]
    rng = random.Random(seed)
    for ids in requests:
        if ids.size:
            n = (int(ids[0]) * 7 + rng.randrange(2)) % engines
            before = len(tapes[n].payloads)
            sims[n].serve(ids)
            order += [(n, p) for p in tapes[n].payloads[before:]]
    return order


def queries(requests: list[np.ndarray], count: int, seed: int = 2) -> list[bytes]:
    rng = random.Random(seed)
    live = [r for r in requests if r.size]
    out = []
    for _ in range(count):
        ids = rng.choice(live)
        tokens = cf.block_tokens(ids).tolist() + [rng.randrange(1 << 17) for _ in range(7)]
        out.append(json.dumps({"token_ids": tokens, "model_name": MODEL}).encode())
    return out


class Service:
    """One service process (sarp serve or Dynamo's indexer) on a free loopback port."""

    def __init__(self, kind: str, work: Path) -> None:
        self.kind, self.work = kind, work
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.index = str(work / "ix") if VALKEY is None else VALKEY.url(f"svc-{self.port}")

    def start(self) -> None:
        if self.kind == "sarp":
            cmd = [sys.executable, "-m", "sarp.cli", "serve", "--index", self.index,
                   "--durability", "nosync", "--http", f"127.0.0.1:{self.port}"]
            # --http-workers: serve's default (the usable cores less one), or the run's
            if SARP_HTTP_WORKERS is not None:
                cmd += ["--http-workers", str(SARP_HTTP_WORKERS)]
            if VALKEY is not None:  # a restart takes over the killed writer's lease
                cmd += ["--lease-s", "2", "--wait-for-lease-s", "30"]
        else:
            python = os.environ.get("SARP_DYNAMO_PYTHON", str(ROOT / ".venv-dynamo/bin/python"))
            cmd = [python, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "4"]
        log = (self.work / f"{self.kind}.log").open("a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                # any answer: up (503: sarp's first answers, before its workers run)
                if cf.post(self.url, "/query", {"token_ids": [], "model_name": "-"},
                           timeout_s=2)[0] in (200, 404, 503):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} did not start (see {self.work})")
            time.sleep(0.02)

    def memory_mib(self) -> tuple[float, float, float]:
        """RSS, PSS and anonymous RSS of the service's process tree (PSS shares a page
        out among the processes that map it: forked workers' shared pages, and an
        index file's pages that several processes read, count once in all; anonymous
        RSS leaves out file pages, which the kernel may drop)."""
        root = psutil.Process(self.proc.pid)
        procs = [p for p in (root, *root.children(recursive=True)) if p.is_running()]
        infos = [p.memory_full_info() for p in procs]
        anon = 0
        for p in procs:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    anon += int(line.split()[1]) << 10
        return (sum(i.rss for i in infos) / (1 << 20), sum(i.pss for i in infos) / (1 << 20),
                anon / (1 << 20))

    def cpu_s(self) -> float:
        """CPU seconds (user and system) the service's process tree has used so far:
        read before and after a phase, the difference over its wall time is the cores
        it kept busy (the processes of the tree at the second reading)."""
        return sum(self.cpu_split_s())

    def cpu_split_s(self) -> tuple[float, float]:
        """:meth:`cpu_s` as (the service's own process, its children): sarp's HTTP
        workers and their zygote, whose share of a drain is their catch-up."""
        root = psutil.Process(self.proc.pid)
        split = [0.0, 0.0]
        for k, p in enumerate((root, *root.children(recursive=True))):
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                split[k > 0] += t.user + t.system
        return split[0], split[1]

    def thread_cpu_s(self) -> dict[tuple[int, int], float]:
        """CPU seconds per thread of the service's process tree so far, by (process,
        thread): read before and after a phase, the busiest thread's share of the wall
        time says whether one thread (sarp's writer) is what holds the rate."""
        root = psutil.Process(self.proc.pid)
        out = {}
        for p in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.NoSuchProcess):
                for t in p.threads():
                    out[p.pid, t.id] = t.user_time + t.system_time
        return out

    def kill(self) -> None:
        """SIGKILL (sarp's HTTP workers see their socket pair close and leave too)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Exchange(asyncio.Protocol):
    """One keep-alive connection of the asyncio client: a request written whole, its
    answer parsed by httptools (sarp's own parser), a future per request."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answered: asyncio.Future | None = None
        self.status = 0
        self.lost: Exception | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.answered.set_result(None)

    def connection_lost(self, exc) -> None:
        self.lost = ConnectionError(f"closed by the service ({exc})")
        if self.answered is not None and not self.answered.done():
            self.answered.set_exception(self.lost)

    async def ask(self, request: bytes) -> int:
        if self.lost is not None:  # closed after an answer: say so, not wait forever
            raise self.lost
        self.answered = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        await self.answered
        return self.status


async def _load(url: str, bodies: list[bytes], seconds: float, clients: int = 8) -> dict:
    """``clients`` keep-alive connections on one asyncio loop (the standard library's),
    each sending ``/query`` and waiting for its answer, for ``seconds``.  An
    ``asyncio.Protocol`` with httptools, not aiohttp: aiohttp's client spent 94-107 µs
    of CPU a request and held both services at about 10,000 requests/s on Mooncake
    (the client, not the service, was measured); this one spends about 20."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    requests = [b"POST /query HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port.encode(), len(b), b)
                for b in bodies]
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal errors
        transport, exchange = await loop.create_connection(_Exchange, host, int(port))
        try:
            i = k
            while time.perf_counter() < stop:
                started = time.perf_counter()
                errors += await exchange.ask(requests[i % len(requests)]) != 200
                latencies.append(time.perf_counter() - started)
                i += clients
        finally:
            transport.close()

    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client(k) for k in range(clients)))
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    ms = np.array(latencies) * 1e3
    # the client's own CPU per request: near 1e6 / requests_per_s, it held the rate
    return {"requests_per_s": len(latencies) / wall, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "requests": len(latencies),
            "errors": errors, "client_cpu_us_per_request": 1e6 * cpu / max(len(latencies), 1)}


_WRK_LUA = """
-- Each of wrk's 2 threads sends every other request, each read whole (head and body,
-- written by the benchmark) from its own file the first time it is sent.  wrk starts
-- a thread as soon as that thread's init ends and then runs the next one's, so an
-- init that read or formatted 2,000 agentic bodies (25,000 tokens each) had one
-- thread loading alone for seconds; and wrk.format took about 2.5 ms a request on
-- them, which held wrk below either service's rate.
local counter = 0
function setup(thread)
  thread:set("id", counter)
  counter = counter + 1
end
local folder, n, loaded = nil, 0, {}
function init(args)
  folder, n = args[1], tonumber(args[2])
end
local i = -1
function request()
  i = (i + 1) % (n / 2)
  local k = 2 * i + id
  local r = loaded[k]
  if not r then
    local f = assert(io.open(folder .. "/" .. k, "rb"))
    r = f:read("*a")
    f:close()
    loaded[k] = r
  end
  return r
end
function done(summary, latency, requests)
  io.write(string.format("WRK %d %d %d %d %f %f\\n", summary.requests, summary.duration,
    summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout, 0,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
"""


def _wrk(url: str, bodies: list[bytes], seconds: float, work: Path, clients: int = 8) -> dict:
    """wrk (a C load generator: 2 threads, ``clients`` keep-alive connections), with
    the requests cycled, each from a file of its own; latency from wrk's own
    histogram."""
    if len(bodies) < 2:
        raise ValueError(f"{len(bodies)} bodies: wrk's 2 threads need 2 or more")
    script, folder = work / "query.lua", work / "bodies"
    script.write_text(_WRK_LUA)
    folder.mkdir(exist_ok=True)
    host = url.split("//", 1)[1].encode()
    for k, body in enumerate(bodies):
        (folder / str(k)).write_bytes(
            b"POST /query HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (host, len(body), body))
    before = os.times()
    out = subprocess.run(["wrk", "-t2", f"-c{clients}", f"-d{seconds:g}s", "-s", str(script),
                          url, "--", str(folder), str(len(bodies) // 2 * 2)],
                         capture_output=True, text=True, check=True)
    after = os.times()  # wrk is the one child reaped meanwhile (services are reaped at stop)
    client_cpu_s = (after.children_user + after.children_system
                    - before.children_user - before.children_system)
    fields = next(ln for ln in out.stdout.splitlines() if ln.startswith("WRK ")).split()
    requests, duration_us, errors = int(fields[1]), int(fields[2]), int(fields[3])
    return {"requests_per_s": requests / (duration_us / 1e6), "p50_ms": float(fields[5]),
            "p99_ms": float(fields[6]), "requests": requests, "errors": errors,
            "seconds": duration_us / 1e6,
            "client_cpu_us_per_request": 1e6 * client_cpu_s / max(requests, 1)}


@contextlib.contextmanager
def engines_and(kind: str, engines: int, batches: int):
    """A fresh service and ``engines`` simulated engines' publishers (each keeping
    ``batches`` for replays), registered and subscribed; yields (service, publishers,
    registrations, work folder)."""
    with tempfile.TemporaryDirectory(prefix=f"sarp-service-{kind}-") as tmp:
        work = Path(tmp)
        context = zmq.Context()
        pubs = [cf.Publisher(context, name=f"e{i}", buffer_batches=batches + 10)
                for i in range(engines)]
        service = Service(kind, work)
        try:
            service.start()
            registrations = [{"instance_id": i + 1, "endpoint": p.endpoint,
                              "replay_endpoint": p.replay_endpoint, "model_name": MODEL,
                              "block_size": cf.BLOCK_SIZE, "dp_rank": 0}
                             for i, p in enumerate(pubs)]
            for body in registrations:
                assert cf.post(service.url, "/register", body)[0] == 201
            for p in pubs:
                p.wait_subscribers(1)
            yield service, pubs, registrations, work
        finally:
            service.stop()
            for p in pubs:
                p.close()
            context.term()


def queued_drain(kind: str, stream: list[tuple[int, bytes]], engines: int) -> dict:
    """On a fresh service: the whole stream and each engine's marker published while
    every process of the service is stopped (SIGSTOP), so that all of it waits in the
    sockets, then the service let go (SIGCONT) and timed until it answers every
    marker.  What the publishing drain of :func:`one_pass` measures too, without the
    engines' publishing in the service's time and on its cores (on 2 cores, the
    benchmark's Python publisher takes about 0.2 s of a 0.6 s Mooncake drain)."""
    events = sum(len(decode(p).events) for _, p in stream)
    with engines_and(kind, engines, len(stream)) as (service, pubs, _, _):
        markers = [cf.Engine(i + 1, 0, MODEL, "vllm-0.33", pubs[i]) for i in range(engines)]
        root = psutil.Process(service.proc.pid)
        procs = [root, *root.children(recursive=True)]
        for proc in procs:
            proc.send_signal(signal.SIGSTOP)
        try:
            for n, payload in stream:
                pubs[n].publish(payload)
            for m in markers:
                m.serve(cf.marker_ids(m))
            time.sleep(QUEUE_SETTLE_S)  # the publishers' sockets pass what they can
        finally:
            cpu, began = service.cpu_s(), time.perf_counter()
            for proc in procs:
                proc.send_signal(signal.SIGCONT)
        cf.wait_for_markers([service.url], markers, timeout_s=600, publish=False)
        drain_s, cpu_s = time.perf_counter() - began, service.cpu_s() - cpu
    return {"queued_drain_events_per_s": events / drain_s, "queued_drain_s": drain_s,
            "queued_drain_cores": cpu_s / drain_s,
            "queued_drain_cpu_us_per_event": 1e6 * cpu_s / events}


def sweep(kind: str, stream: list[tuple[int, bytes]], engines: int, rates: list[float],
          step_s: float) -> list[dict]:
    """On a fresh service: the stream published at each offered rate (events/s) for
    ``step_s``, going on from where the last rate left off (round again at its end), and
    every 50 ms a probe (one new block, on the next engine, in order with its stream)
    timed until the service answers it: lag p50 and p99 per rate, and the cores the
    service's processes kept busy meanwhile (``cores``; ``cpu_us_per_event``) and the
    busiest thread of them (``busiest_thread_cores``: sarp's writer).  A rate
    whose lag passes 2 s ends the sweep (every higher one would too)."""
    import threading

    events_of = [len(decode(p).events) for _, p in stream]
    with engines_and(kind, engines, len(stream)) as (service, pubs, _, _):
        out: list[dict] = []
        probes = [cf.Engine(i + 1, 0, MODEL, "vllm-0.33", pubs[i]) for i in range(engines)]
        at, probe_id = 0, 1 << 61
        for rate in rates:
            probing = _Probes(service.url)
            watcher = threading.Thread(target=probing.watch, daemon=True)
            watcher.start()
            cpu, threads, began = service.cpu_s(), service.thread_cpu_s(), time.perf_counter()
            sent_events, next_probe, k = 0, began, 0
            while (now := time.perf_counter()) - began < step_s and watcher.is_alive():
                if now >= next_probe:
                    ids = np.array([probe_id], np.uint64)
                    probe_id += 1
                    probes[k % engines].serve(ids)
                    probing.sent(ids, k % engines + 1)
                    k += 1
                    next_probe += 0.05
                due = (now - began) * rate
                while sent_events < due:
                    n, payload = stream[at % len(stream)]
                    pubs[n].publish(_stamped(payload))
                    sent_events += events_of[at % len(stream)]
                    at += 1
                time.sleep(0.0005)
            elapsed, cpu_s = time.perf_counter() - began, service.cpu_s() - cpu
            busiest = max((t - threads.get(k, 0.0) for k, t in service.thread_cpu_s().items()),
                          default=0.0)
            probing.done.set()
            watcher.join(30)
            ms = np.array(probing.lags) * 1e3
            point = {"offered_events_per_s": rate,
                     "achieved_events_per_s": sent_events / elapsed,
                     "cores": cpu_s / elapsed,
                     "busiest_thread_cores": busiest / elapsed,
                     "cpu_us_per_event": 1e6 * cpu_s / max(sent_events, 1),
                     "lag_p50_ms": float(np.percentile(ms, 50)) if ms.size else None,
                     "lag_p99_ms": float(np.percentile(ms, 99)) if ms.size else None,
                     "probes": int(ms.size)}
            out.append(point)
            if not ms.size or ms.max() > 2000:
                break
    return out


def _stamped(payload: bytes) -> bytes:
    """A recorded batch stamped with the time it is published, as a live engine stamps
    it.  The stream was recorded before the sweep, and goes round again; the probes are
    stamped as they are sent, so a recorded batch after a probe had looked seconds older
    than the batch before it, which sarp takes for an engine that restarted (it proves
    the engine's continuity from its replay buffer first: a replay per probe)."""
    if payload[:2] in (b"\x92\xcb", b"\x93\xcb"):  # [ts (float64), events, rank?]
        return payload[:2] + struct.pack(">d", time.time()) + payload[10:]
    return payload


class _Probes:
    """The probes of one rate: each timed until the service answers it (oldest first);
    one past 2 s ends the watch."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.lags, self.pending = url, [], []
        self.lock, self.done = threading.Lock(), threading.Event()

    def sent(self, ids: np.ndarray, iid: int) -> None:
        body = {"token_ids": cf.block_tokens(ids).tolist(), "model_name": MODEL}
        with self.lock:
            self.pending.append((time.perf_counter(), body, iid))

    def watch(self) -> None:
        while not self.done.is_set() or self.pending:
            with self.lock:
                head = self.pending[0] if self.pending else None
            if head is None:
                time.sleep(0.002)
                continue
            sent, body, iid = head
            got = cf.post(self.url, "/query", body, timeout_s=10)[1]
            late = time.perf_counter() - sent
            if str(iid) in got.get("scores", {}) or late > 2.0:
                self.lags.append(late)
                with self.lock:
                    self.pending.pop(0)
                if late > 2.0:
                    return
            else:
                time.sleep(0.002)


REACHED = 0.95  # of an offered rate the engines must publish for it to count
SETTLE_S = 2.0  # after the drain, when the memory is read again


def held(points: list[dict], bound_ms: float = 100.0) -> float:
    """The highest offered rate whose lag p99 stayed within ``bound_ms``, of those the
    engines reached (``REACHED`` of it published: on this 2-core machine a service
    that takes more CPU leaves the publishing engines less, and an offered rate they
    fell short of was never asked of the service)."""
    ok = [p["offered_events_per_s"] for p in points
          if p["lag_p99_ms"] is not None and p["lag_p99_ms"] <= bound_ms
          and p["achieved_events_per_s"] >= REACHED * p["offered_events_per_s"]]
    return max(ok, default=0.0)


def rescore(result: dict) -> dict:
    """An earlier run's result with each pass's rate held, and its median and ratio,
    scored again by :func:`held` from the pass's sweep."""
    metric, runs = "rate_held_events_per_s", result["runs"]
    for rs in runs.values():
        for r in rs:
            if "sweep" in r:
                r[metric] = held(r["sweep"])
    summarize(result, metric)
    return result


def summarize(result: dict, metric: str) -> float | None:
    """``metric``'s median per service into ``result["median"]``, and sarp's over
    Dynamo's into ``result["ratio"]`` (None unless both ran); returns the ratio."""
    runs = result["runs"]
    med = {kind: statistics.median(r[metric] for r in rs) for kind, rs in runs.items()}
    result["median"][metric] = med
    ratio = med["sarp"] / med["dynamo"] if len(med) == 2 and med["dynamo"] else None
    result["ratio"][metric] = ratio
    return ratio


def one_pass(kind: str, stream: list[tuple[int, bytes]], engines: int, bodies: list[bytes],
             args) -> dict:
    with engines_and(kind, engines, len(stream)) as (service, pubs, bodies_reg, work):
        markers = [cf.Engine(i + 1, 0, MODEL, "vllm-0.33", pubs[i]) for i in range(engines)]
        split, started = service.cpu_split_s(), time.perf_counter()
        for n, payload in stream:
            pubs[n].publish(payload)
        cf.wait_for_markers([service.url], markers, timeout_s=600)
        drain_s = time.perf_counter() - started
        own, children = (b - a for a, b in zip(split, service.cpu_split_s(), strict=True))
        drain_cpu_s = own + children
        events = sum(len(decode(p).events) for _, p in stream)
        rss, pss, anon = service.memory_mib()
        time.sleep(SETTLE_S)  # and once the service has had its idle moment (a trim, a GC)
        settled = service.memory_mib()
        http = asyncio.run(_load(service.url, bodies, args.http_s))
        if shutil.which("wrk"):
            cpu = service.cpu_s()
            http |= {f"wrk_{k}": v for k, v in
                     _wrk(service.url, bodies, args.http_s, work).items()}
            # over wrk's own load time (its start loads nothing)
            wrk_cpu_s, wrk_s = service.cpu_s() - cpu, http["wrk_seconds"]
            http |= {"wrk_cores": wrk_cpu_s / wrk_s,
                     "wrk_cpu_us_per_request": 1e6 * wrk_cpu_s / max(http["wrk_requests"], 1)}
        sample = bodies[:50]
        # the recorded bodies as they are: decoding and encoding an agentic body again in
        # this client took about 4 ms a request, most of a check's 50, for either service
        before = [cf.post(service.url, "/query", b) for b in sample]
        service.kill()
        killed = time.perf_counter()
        service.start()
        if kind == "dynamo":
            for body in bodies_reg:
                cf.post(service.url, "/register", body)
        for p in pubs:  # subscribed again (a batch sent before would reach nobody)
            p.wait_subscribers(1)
        for m in markers:  # one more batch each: a gap to replay from
            m.serve(cf.marker_ids(m) + np.uint64(1 << 20))
        while (after := [cf.post(service.url, "/query", b) for b in sample]) != before:
            if time.perf_counter() - killed > args.restart_timeout_s:
                wrong = next((b, a) for b, a in zip(before, after, strict=True) if b != a)
                raise RuntimeError(f"{kind}: no correct answers {args.restart_timeout_s:.0f}"
                                   f" s after the kill; before and after: {wrong}")
            time.sleep(0.02)
        restart_s = time.perf_counter() - killed
        return {"drain_events_per_s": events / drain_s, "drain_s": drain_s,
                "drain_cores": drain_cpu_s / drain_s,
                "drain_cpu_us_per_event": 1e6 * drain_cpu_s / events,
                "drain_children_cpu_share": children / drain_cpu_s if drain_cpu_s else 0.0,
                "rss_mib": rss, "pss_mib": pss, "anon_rss_mib": anon,
                "rss_settled_mib": settled[0], "pss_settled_mib": settled[1],
                "anon_rss_settled_mib": settled[2],
                **{f"http_{k}": v for k, v in http.items()},
                "kill9_to_correct_s": restart_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="the trace to record the engines' stream from")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--http-s", type=float, default=5.0)
    ap.add_argument("--restart-timeout-s", type=float, default=120.0)
    ap.add_argument("--services", default="sarp,dynamo")
    ap.add_argument("--rates", default="10000,20000,40000,80000,160000",
                    help="offered events/s of the rate sweep, comma-separated ('' for none)")
    ap.add_argument("--rate-s", type=float, default=2.0, help="seconds per offered rate")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sarp-valkey", action="store_true",
                    help="sarp's index on a Valkey server the run starts (serve on Valkey)")
    ap.add_argument("--sarp-http-workers", type=int, default=None,
                    help="sarp serve's --http-workers (default: serve's own default; 0: "
                    "HTTP on a thread of serve's own)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="draw the rate sweep and the ratios here (.png)")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="only draw --plot from the JSON of an earlier run")
    args = ap.parse_args()
    if args.replot is not None:
        result = rescore(json.loads(args.replot.read_text()))
        args.replot.write_text(json.dumps(result, indent=1))
        plot(result, args.plot or args.replot.with_suffix(".png"))
        return 0
    if args.trace is None:
        ap.error("--trace is required (unless --replot)")
    # sarp's bytecode written now, as a wheel's install writes it: serve is started
    # again and again, and from an editable install with PYTHONDONTWRITEBYTECODE set
    # (as on these machines) each start would compile ~60 modules first (about 0.1 s)
    compileall.compile_dir(Path(sarp.__file__).parent, quiet=1)
    global SARP_HTTP_WORKERS
    SARP_HTTP_WORKERS = args.sarp_http_workers
    if args.sarp_valkey:
        from sarp.bench.valkey_server import ValkeyServer

        global VALKEY
        VALKEY = ValkeyServer()
    try:
        return run(args)
    finally:
        if VALKEY is not None:
            VALKEY.stop()


def run(args) -> int:
    """The passes and their report (see the module)."""
    rates = [float(r) for r in args.rates.split(",") if r]
    requests = [r.hashes for _, r in zip(range(args.requests), read_requests(args.trace),
                                         strict=False)]
    stream = record(requests, args.engines)
    bodies = queries(requests, 2000)
    print(f"{len(stream):,} batches from {len(requests):,} requests, {args.engines} engines",
          flush=True)
    runs: dict[str, list[dict]] = {k: [] for k in args.services.split(",")}
    for k in range(args.repeat):
        for kind in runs:
            got = one_pass(kind, stream, args.engines, bodies, args)
            got |= queued_drain(kind, stream, args.engines)
            if rates:
                points = sweep(kind, stream, args.engines, rates, args.rate_s)
                got["rate_held_events_per_s"] = held(points)
                got["sweep"] = points
            runs[kind].append(got)
            print(f"pass {k + 1} {kind}: " + ", ".join(f"{m} {v:,.1f}" for m, v in got.items()
                                                       if m != "sweep"), flush=True)
    from sarp.serving.workers import default_workers

    out: dict = {"trace": args.trace, "requests": args.requests, "engines": args.engines,
                 "batches": len(stream),
                 "sarp_http_workers": default_workers() if args.sarp_http_workers is None
                 else args.sarp_http_workers,
                 "runs": runs, "median": {}, "ratio": {}}
    for metric in next(iter(runs.values()))[0]:
        if metric == "sweep":
            continue
        ratio = summarize(out, metric)
        med = out["median"][metric]
        print(f"{metric}: " + ", ".join(
            f"{kind} {med[kind]:,.2f} ({min(r[metric] for r in rs):,.2f}-"
            f"{max(r[metric] for r in rs):,.2f})" for kind, rs in runs.items())
            + ("" if ratio is None else f", sarp/dynamo {ratio:.2f}"), flush=True)
    # per offered rate, the medians over passes of the lag and of the cores kept busy
    out["sweep"] = {}
    for rate in rates:
        at = {kind: [p for r in rs for p in r.get("sweep", []) if p["offered_events_per_s"]
                     == rate and p["lag_p99_ms"] is not None] for kind, rs in runs.items()}
        out["sweep"][rate] = {kind: {m: statistics.median(p[m] for p in points) for m in
                                     ("lag_p50_ms", "lag_p99_ms", "cores",
                                      "busiest_thread_cores") if all(m in p for p in points)}
                              for kind, points in at.items() if points}
        print(f"at {rate:,.0f} events/s: " + ", ".join(
            f"{kind} lag p50/p99 {v['lag_p50_ms']:.1f}/{v['lag_p99_ms']:.1f} ms, "
            f"{v['cores']:.2f} cores, busiest thread {v.get('busiest_thread_cores', 0):.2f}"
            for kind, v in out["sweep"][rate].items()), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(out, args.plot)
    return 0


# what each ratio is held to (issue 26): at least, or at most, this much of Dynamo's
TARGETS = {"drain_events_per_s": (">=", 1.5), "queued_drain_events_per_s": (">=", 1.5),
           "rate_held_events_per_s": (">=", 1.5),
           "http_requests_per_s": (">=", 1.5), "http_p99_ms": ("<=", 0.7),
           "http_wrk_requests_per_s": (">=", 1.5), "http_wrk_p99_ms": ("<=", 0.7),
           "kill9_to_correct_s": ("<=", 0.3), "rss_mib": ("<=", 1.0)}


def plot(result: dict, out: Path) -> None:
    """Left: every pass's rate sweep, probe lag p99 against the offered rate, per
    service (the 100 ms line is what "held" means; hollow: a rate the engines fell
    short of, never held).  Right: sarp/Dynamo of the medians
    against each target (green where it is met)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    for color, (kind, runs) in zip(("C0", "C1"), result["runs"].items(), strict=False):
        for k, run in enumerate(runs):
            points = [p for p in run.get("sweep", []) if p["lag_p99_ms"] is not None]
            left.plot([p["offered_events_per_s"] for p in points],
                      [p["lag_p99_ms"] for p in points], "o-", c=color, alpha=0.8,
                      label=kind if k == 0 else None)
            short = [p for p in points  # rates the engines fell short of: not held
                     if p["achieved_events_per_s"] < REACHED * p["offered_events_per_s"]]
            left.plot([p["offered_events_per_s"] for p in short],
                      [p["lag_p99_ms"] for p in short], "o", mfc="white", c=color,
                      label=f"{kind}: engines short of the rate" if short and k == 0 else None)
    rates = sorted({p["offered_events_per_s"] for runs in result["runs"].values()
                    for run in runs for p in run.get("sweep", [])
                    if p["lag_p99_ms"] is not None})
    if rates:
        left.axhline(100, ls="--", c="gray", lw=1)
        left.set_xscale("log")
        left.set_xticks(rates, labels=[f"{r / 1000:g}k" for r in rates])
        left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        left.set_yscale("log")
        left.legend()
    else:
        left.text(0.5, 0.5, "no rate sweep in this run (--rates '')", ha="center",
                  transform=left.transAxes)
        left.set_xticks([])
        left.set_yticks([])
    left.set_xlabel("offered events/s")
    left.set_ylabel("probe lag p99, ms")
    left.set_title("rate sweep (each pass)")
    names = [m for m in TARGETS if result["ratio"].get(m)]
    values = [result["ratio"][m] for m in names]
    met = [(v >= TARGETS[m][1]) if TARGETS[m][0] == ">=" else (v <= TARGETS[m][1])
           for m, v in zip(names, values, strict=True)]
    right.barh([f"{m} ({TARGETS[m][0]} {TARGETS[m][1]})" for m in names], values,
               color=["C2" if ok else "C3" for ok in met])
    right.plot([TARGETS[m][1] for m in names], range(len(names)), "k|", ms=16,
               label="target")
    right.axvline(1.0, c="gray", lw=1)
    right.set_xscale("log")
    ticks = [0.1, 0.2, 0.5, 1, 2, 5]
    right.set_xticks(ticks, labels=[f"{t:g}" for t in ticks])
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.set_xlim(0.08, 6)
    right.legend(loc="lower right")
    right.set_xlabel("sarp / Dynamo (medians; log)")
    right.set_title("against the targets (green: met)")
    fig.suptitle(f"{Path(result['trace']).name}: {result['engines']} engines, "
                 f"{result['batches']:,} batches, {len(next(iter(result['runs'].values())))} "
                 "interleaved passes")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
