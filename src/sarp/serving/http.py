"""``sarp serve --http HOST:PORT``: the index as a service for routers in any language.

Endpoints:

* ``POST /v1/match`` with ``{"block_hashes": [int, ...]}`` (uint64 or signed int64),
  or ``{"token_ids": [int, ...]}`` hashed in the scheme ``sarp serve`` was given;
  optional ``"block_size"`` (token counts; required with ``token_ids`` unless serve
  has one) and ``"weights"`` (per medium).  The answer is :func:`router.score`'s:
  ``{"matched_blocks": N, "instances": [{"instance", "engine", "dp_rank",
  "matched_blocks", "matched_tokens", "by_medium", "score"}, ...]}``, best first.
  ``{"requests": [[int, ...], ...]}`` asks for many requests at once (a scheduler
  step, answered by one ``match_many``) and gets ``{"results": [answer, ...]}``,
  one answer of that shape per request, in order.
  Bad input gets ``400`` and ``{"error": ..., "field": ...}``; the server stays up.
* ``GET /metrics``: Prometheus text.  Per source (read from the writer's status
  file at scrape time): batches, events, gaps, replays, engine restarts, bad
  batches, bad frames, bad events by kind, seconds since the last applied batch.
  Per service (summed over the worker processes): matches and a match-latency
  histogram.  Index sizes.
* ``GET /healthz``: the worker is alive.  ``GET /readyz``: every source has been
  caught up since serve started, and the writer's status is fresh.

Queries are answered by worker processes, each with its own ``readonly=True`` open
of the index and its own HTTP server (:mod:`sarp.serving.wire`).  Processes, not
threads, because ingestion and matching are both CPU work in Python: in one process
they would take turns on the GIL, and a burst of queries would stall ingestion
(``--http-workers 0`` chooses that, for half the memory: :mod:`sarp.serving.inprocess`).
serve's process owns the listening socket and deals each accepted connection to the
workers in turn (its file descriptor passed over a Unix socket pair,
:mod:`sarp.serving.workers`): a gateway's pool of 8 keep-alive connections lands 4
and 4 on two workers, where ``SO_REUSEPORT``'s hash put 7 on one of them in one run
of 5; and workers whose serve is gone see their socket pair close and exit instead
of answering on.  Handlers are plain functions of a request; the work of a body over
1 MiB, and of token ids in vLLM's schemes, is done beside the event loop (one
thread), so ``/healthz`` is answered meanwhile.
orjson parses a 1,350-hash body in a quarter of the time of the standard ``json``.
prometheus_client's multiprocess mode sums the workers' counters.  This module is
the only one that imports orjson and prometheus_client.
"""

from __future__ import annotations

import array
import asyncio
import functools
import hmac
import itertools
import json
import logging
import math
import os
import re
import socket
import sys
import time
from pathlib import Path

import numpy as np
import orjson

from .. import __version__, native
from ..errors import SarpError
from ..hashing import as_hashes, hash_blocks
from . import openapi, rfc, wire
from .status import (
    STATUS_FILE,
    read_status,
    readiness,
    registration_problem,
    status_metrics,
    submit,
    workers_listed,
)
from .workers import HttpConfig

log = logging.getLogger("sarp.http")

MAX_BODY_BYTES = 8 << 20  # 1M hashes as JSON text
# Work one request may ask for: 262,144 blocks is 4M tokens at block size 16, past any
# context an engine serves, and hashing that many in the vLLM schemes takes about a
# second (off the event loop: /healthz is answered meanwhile).
MAX_REQUEST_BLOCKS = 1 << 18
MAX_REQUEST_CHAINS = 4096
HEARTBEAT_S = 0.1  # a worker's loop stamps its slot this often
FOLD_S, WARM_S = 0.1, 1.0  # a worker's counts reach Prometheus this often, from WARM_S
SWITCH_INTERVAL_S = 0.001  # the workers' GIL hand-over interval (Python's default: 5 ms)
_U64_MAX = (1 << 64) - 1
_I64_MIN = -(1 << 63)


class BadRequest(ValueError):
    """A request the service refuses: ``field`` names what is wrong."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


def _too_many(field: str, count: int) -> BadRequest:
    return BadRequest(field, f"{field} has {count} blocks; one request may ask for at most "
                             f"{MAX_REQUEST_BLOCKS} (split it, or send fewer tokens)", 413)


def parse_match(body: bytes, config: HttpConfig) -> dict:
    """Check a ``/v1/match`` body; return the keyword arguments for ``score_match``.

    >>> cfg = HttpConfig("ix", "m")
    >>> parse_match(b'{"block_hashes": [1, -1], "block_size": 16}', cfg)["hashes"].tolist()
    [1, 18446744073709551615]
    """
    # (ids parsed in C without the GIL, where a 3 MB body's orjson parse held it 13 ms)
    obj = _with_fast_block_hashes(body) or _with_fast_block_hashes(body, b"token_ids")
    if obj is None:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest("body", f"the body is not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise BadRequest("body", "the body must be a JSON object, e.g. "
                                 '{"block_hashes": [1, 2, 3]}')
    unknown = set(obj) - {"block_hashes", "token_ids", "requests", "block_size", "weights"}
    if unknown:
        raise BadRequest(sorted(unknown)[0], f"unknown field {sorted(unknown)[0]!r}; known: "
                         "block_hashes, token_ids, requests, block_size, weights")
    block_size = obj.get("block_size", None)
    if block_size is not None and not _is_int(block_size, 1, 1 << 20):
        raise BadRequest("block_size", f"block_size must be an int from 1 to 2**20, got "
                                       f"{_show(block_size)}")
    weights = obj.get("weights", None)
    if weights is not None:
        if not isinstance(weights, dict):
            raise BadRequest("weights", 'weights must be an object, e.g. {"GPU": 1.0}')
        for medium, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) \
                    or w < 0:
                raise BadRequest(f"weights.{medium}", f"weight for {medium!r} must be a finite "
                                                      f"number >= 0, got {_show(w)}")
    out: dict = {"block_size": block_size}
    if weights is not None:
        out["weights"] = weights
    if sum(key in obj for key in ("block_hashes", "token_ids", "requests")) != 1:
        raise BadRequest("block_hashes", "pass exactly one of block_hashes, token_ids and "
                                         "requests")
    if "block_hashes" in obj:
        out["hashes"] = _hash_array(obj["block_hashes"], "block_hashes")
        if out["hashes"].size > MAX_REQUEST_BLOCKS:
            raise _too_many("block_hashes", out["hashes"].size)
        return out
    if "requests" in obj:
        chains = obj["requests"]
        if not isinstance(chains, list) or not chains:
            raise BadRequest("requests", "requests must be a non-empty array of block_hashes "
                                         f"arrays, e.g. [[1, 2], [3]]; got {_show(chains)}")
        if len(chains) > MAX_REQUEST_CHAINS:
            raise BadRequest("requests", f"requests has {len(chains)} chains; send at most "
                                         f"{MAX_REQUEST_CHAINS} in one call", 413)
        out["chains"] = [_hash_array(c, f"requests[{i}]") for i, c in enumerate(chains)]
        total = sum(c.size for c in out["chains"])
        if total > MAX_REQUEST_BLOCKS:
            raise _too_many("requests", total)
        return out
    tokens = obj["token_ids"]  # (u32 parsed in C, or checked here)
    tokens = tokens.tolist() if isinstance(tokens, np.ndarray) else _int_list(
        tokens, "token_ids", 0, 0xFFFFFFFF)
    size = block_size or config.block_size
    if size is None:
        raise BadRequest("block_size", "token_ids need a block_size (in the request, or "
                                       "sarp serve --block-size)")
    if len(tokens) // size > MAX_REQUEST_BLOCKS:
        raise _too_many("token_ids", len(tokens) // size)
    try:
        out["hashes"] = hash_blocks(tokens, size, scheme=config.scheme, seed=config.seed)
    except ValueError as exc:
        raise BadRequest("token_ids", str(exc)) from None
    out["block_size"] = size
    return out


# JSON's own whitespace only: a regex ``\s`` also takes \x0b and \x0c, which the
# general parse refuses (30,192 bodies answered differently; tests/test_hardening.py)
_WS = rb"[ \t\n\r]*"
_FAST_HEADS = {f: re.compile(_WS + rb'\{' + _WS + b'"' + f + b'"' + _WS + rb':' + _WS + rb'\[')
               for f in (b"block_hashes", b"token_ids")}


def _with_fast_block_hashes(body: bytes, field: bytes = b"block_hashes") -> dict | None:
    """A body that begins ``{"block_hashes": [`` (or ``field``: ``token_ids``) and
    holds no other such field and no escape: the ints parsed in C straight into a
    uint64 array (token ids: uint32, each in range; no Python int per item), the rest
    of the object by orjson.  ``None`` for any other body, or any doubt, and the caller
    parses the whole body, which names what is wrong.

    >>> obj = _with_fast_block_hashes(b'{"block_hashes": [1, -1], "block_size": 16}')
    >>> obj is None or (obj["block_hashes"].tolist(), obj["block_size"]) == ([1, 2**64 - 1], 16)
    True
    """
    c = native.C
    if c is None:
        native.ran_python("u64_array")
        return None
    head, quoted = _FAST_HEADS[field].match(body), b'"' + field + b'"'
    end = body.find(b"]", head.end()) if head is not None else -1
    if end < 0:
        return None
    # The head holds the field once and no escape, and the array only ints, commas and
    # white space (else u64_array says None): another such field, or an escape that
    # could spell one, can only be in what follows the array, which alone is searched
    # (a search of the whole 150 kB body of an agentic query took 90 us).
    tail = body[end + 1 :]
    if quoted in tail or b"\\" in tail:
        return None
    tokens = field == b"token_ids"
    raw = c.u64_array(body, head.end(), end, tokens)
    if raw is None:
        return None
    try:
        obj = orjson.loads(b"{" + quoted + b":[]" + tail)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict or obj.get(field.decode()) != []:
        return None
    obj[field.decode()] = np.frombuffer(raw, np.uint32 if tokens else np.uint64)
    return obj


def _hash_array(value: object, field: str) -> np.ndarray:
    """``block_hashes`` as a uint64 array, converted in C when they are plain ints.

    ``array.array`` converts a list of ints in one C loop and refuses floats, strings
    and None; only bools slip through (as 0 and 1), so the few items <= 1 are checked
    by type.  Anything else takes the item-by-item path, which names the bad item.
    An array parsed by :func:`_with_fast_block_hashes` is taken as it is.
    """
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, list):
        for code in ("Q", "q"):  # uint64 (vLLM), then int64 (SGLang's signed hashes)
            try:
                arr = np.frombuffer(array.array(code, value), dtype=np.uint64)
            except (TypeError, OverflowError):
                continue
            small = np.flatnonzero(arr <= 1)
            if not any(type(value[i]) is bool for i in small.tolist()):
                return arr
            break
    return as_hashes(_int_list(value, field, _I64_MIN, _U64_MAX), allow_empty=True)


def _int_list(value: object, field: str, low: int, high: int) -> list[int]:
    if not isinstance(value, list):
        raise BadRequest(field, f"{field} must be an array of ints, got {_show(value)}")
    if value and all(type(v) is int for v in value) and low <= min(value) and max(value) <= high:
        return value  # the common case, checked without a Python call per item
    for i, v in enumerate(value):
        if not _is_int(v, low, high):
            raise BadRequest(f"{field}[{i}]", f"{field}[{i}] must be an int from {low} to "
                                              f"{high}, got {_show(v)}")
    return value


def _is_int(v: object, low: int, high: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _show(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(
        value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- the worker -----------------------------------------------------------------------------


def mark_worker_dead(pid: int, metrics_dir: str) -> None:
    """Fold a dead worker's metrics files into the totals (prometheus_client's
    multiprocess mode), so its replacement starts its own."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, metrics_dir)


def worker_main(config: HttpConfig, channel: socket.socket, heartbeats=None,
                slot: int = 0) -> None:
    """One HTTP worker process: a readonly open of the index, and the HTTP server
    (:mod:`sarp.serving.wire`) for the connections serve's dealer
    (:mod:`sarp.serving.workers`) passes over ``channel``.  Its loop stamps
    ``heartbeats[slot]`` every ``HEARTBEAT_S``.  It stops at SIGTERM or SIGINT, or when
    serve closes (or loses) its end."""
    import_for_workers(config.metrics_dir)  # (done by the zygote; not by a spawned worker)
    import sarp

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # The parse thread (token ids hashed in Python) hands the GIL back to the event loop
    # every millisecond instead of every 5: /healthz and small matches wait less
    # behind a maximal request.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    index = sarp.open_shards(config.index_path) if config.sharded else sarp.open(
        config.index_path, readonly=True)
    chores = [] if heartbeats is None else [lambda: stamping(heartbeats, slot)]
    try:
        wire.run(make_server(index, config), channel, chores)
    finally:
        index.close()


def import_for_workers(metrics_dir: str) -> None:
    """The HTTP zygote's, before it forks workers: the event loop imported, and
    ``metrics_dir`` named for prometheus_client's multiprocess mode, which it reads at
    its import (:class:`_Metrics`).  Cost: a few ms, once."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    wire.import_loop()


class _Metrics:
    """A worker's Prometheus metrics, made at first use (its first fold, ``WARM_S``
    after its start, or a ``/metrics``): prometheus_client's import (25-35 ms) is off a
    restart's path to the first answers.  Cost: one import, once; then attributes."""

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        import prometheus_client.multiprocess  # noqa: F401
        from prometheus_client import Counter, Histogram, values

        # its values read the pid a fork hook keeps, not os.getpid() (a system call)
        values.ValueClass = values.MultiProcessValue(process_identifier=_pid)
        self.matches = Counter("sarp_matches", "match requests answered")
        self.rejected = Counter("sarp_match_rejected", "match requests refused with 400")
        self.latency = Histogram("sarp_match_seconds", "time to answer one match request",
                                 buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                                          2.5e-2, 0.1, 1))
        self.closed = Counter("sarp_http_connections_closed", "connections closed for "
                              "taking too long: to send a request, to be answered, or idle",
                              ["reason"])
        return object.__getattribute__(self, name)


_METERS = _Metrics()  # one per process: a thread of serve's restarted keeps them

_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def _pid() -> int:
    """This process's id, as of its last fork (``os.getpid`` without the call)."""
    return _PID[0]


async def stamping(heartbeats, slot: int) -> None:
    """A worker's chore: its slot of ``heartbeats`` stamped every ``HEARTBEAT_S``."""
    while True:
        heartbeats[slot] = time.monotonic()
        await asyncio.sleep(HEARTBEAT_S)


def make_server(index, config: HttpConfig) -> wire.Server:
    """One worker's routes and bounds (see the module docstring)."""
    from .router import score_many, score_match

    meters = _METERS
    path = Path(config.status_dir or config.index_path)
    models = rfc.Models(read_status, path, STATUS_FILE)

    # Requests with token ids (hashed in Python, about 4 us a block in the vLLM schemes)
    # and large bodies are answered here, parse to match, so the event loop answers
    # /healthz meanwhile; one thread, so that a burst of them queues instead of
    # crowding the core.
    offload = wire.Beside("sarp-parse")
    token = b"Bearer " + config.token.encode() if config.token else None
    # On Valkey every match waits for the server, and a reader's catch-up may load a
    # snapshot from it: all of them beside the loop (a thread hop costs a fraction of
    # the round trip), so /healthz never waits behind one.
    remote = "://" in config.index_path
    # a /query answered in one C call when it can be (rfc.answer_now), from what the
    # index's match reads (Index.reading())
    reading = None if remote or config.sharded else rfc.reading_of(index.reading())
    # on a thread of serve's own (in_process): the writer's index, whose memory C reads
    # between its commits
    beside_writer = reading is not None and not index.readonly

    def refuse(field: str, message: str, status: int = 400, close: bool = False
               ) -> wire.Response:
        next(refused)
        return _json({"error": message, "field": field}, status, close)

    def unavailable(exc: SarpError) -> wire.Response:  # the store is away: say so, go on
        return _json({"error": f"the index cannot be read now ({exc}); try again",
                      "field": "index"}, 503)

    def answered_beside(work, args) -> wire.Response:
        try:
            return work(*args)
        except SarpError as exc:
            return unavailable(exc)

    def beside(work, *args) -> asyncio.Future:
        return offload(answered_beside, work, args)

    def guarded(handler, probe: bool = False, authorization=lambda r: r.headers.get(
            b"authorization")):
        def handle(request, *more):  # a Request, or a fast route's body and authorization
            if token is not None and not probe and not hmac.compare_digest(
                    authorization(request, *more) or b"", token):
                return _json({"error": "send the token of --http-token-file as "
                                       "'Authorization: Bearer TOKEN'",
                              "field": "Authorization"}, 401)
            try:
                return handler(request)
            except SarpError as exc:
                return unavailable(exc)
        return handle

    def answer_of(body: bytes) -> dict:
        kwargs = parse_match(body, config)
        if "chains" in kwargs:
            chains = kwargs.pop("chains")
            live = [i for i, c in enumerate(chains) if c.size]
            answers = [_NOTHING] * len(chains)
            for i, (m, scores) in zip(live, score_many(index, [chains[i] for i in live],
                                                       **kwargs), strict=True):
                answers[i] = _answer(m, scores)
            return {"results": answers}
        if kwargs["hashes"].size:
            return _answer(*score_match(index, **kwargs))
        return _NOTHING  # no full block: nothing can be cached

    def match_answer(body: bytes, started: float) -> wire.Response:
        try:
            answer = answer_of(body)
        except BadRequest as exc:
            return refuse(exc.field, str(exc), exc.status)
        timings.append(time.perf_counter() - started)
        next(answered)
        return wire.Response(orjson.dumps(answer))

    def match(request: wire.Request):
        body, started = request.body, time.perf_counter()
        if remote or len(body) > OFFLOAD_BYTES or b'"token_ids"' in body:
            # a large request, parsed, hashed and matched beside the event loop
            return beside(match_answer, body, started)
        return match_answer(body, started)

    def answer_now(body: bytes) -> bytes | None:
        got = rfc.answer_now(body, models.get(), reading)
        if got is None and beside_writer:  # the writer's commit going into memory?
            with reading[0]:  # (its memory lock, held for a few ms: wait it out)
                got = rfc.answer_now(body, models.get(), reading)
        return got

    def rfc_answer(body: bytes, by_hash: bool) -> bytes | wire.Response:
        if not by_hash and (got := answer_now(body)) is not None:
            next(answered)
            return got  # answered in one C call
        try:
            fields = None if by_hash else rfc.query_fields(body)  # one C pass, when it can
            if fields is None:
                obj = _with_fast_block_hashes(body, b"block_hashes" if by_hash
                                              else b"token_ids")  # the ids parsed in C
                obj = orjson.loads(body) if obj is None else obj
                parse = functools.partial(rfc.parse_query, obj, by_hash)
            else:
                parse = functools.partial(rfc.query_keys, fields)
            try:
                model, keys = parse(models.get())
            except rfc.QueryError as exc:  # no such model, maybe as of a table a moment old
                if exc.status != 404:
                    raise
                model, keys = parse(models.get(fresh=True))
        except orjson.JSONDecodeError as exc:
            return refuse("body", f"the body is not JSON ({exc})")
        except rfc.QueryError as exc:
            return refuse(exc.field, str(exc), exc.status)
        got = rfc_json(index.match(keys, with_presence="rows"), model) if keys.size \
            else _EMPTY_RFC
        next(answered)  # (folded into `matches` by a chore: a Counter.inc is 1 µs)
        return got  # (200 JSON: the fast routes send it as it is)

    def rfc_response(body: bytes, by_hash: bool) -> wire.Response:
        got = rfc_answer(body, by_hash)
        return wire.Response(got) if isinstance(got, bytes) else got

    def rfc_query(by_hash: bool):  # RFC #1403's /query and /query_by_hash
        def handle(request: wire.Request):
            if remote or len(request.body) > OFFLOAD_BYTES:  # beside the event loop
                return beside(rfc_response, request.body, by_hash)
            return rfc_response(request.body, by_hash)
        return handle

    alive = orjson.dumps({"status": "alive", "pid": os.getpid()})  # (a worker's, forked)

    def healthz(_: wire.Request) -> wire.Response:
        return wire.Response(alive)

    def readyz(_: wire.Request) -> wire.Response:
        body = readiness(read_status(path))
        return _json(body, 200 if body["ready"] else 503)

    # answers and refusals counted (next() is atomic), /v1/match's times kept, until
    # a fold takes them into `meters` on the loop: every FOLD_S, and at /metrics
    answered, refused, timings, folded = itertools.count(), itertools.count(), [], [0, 0]

    def fold() -> None:
        now, out = next(answered), next(refused)
        meters.matches.inc(now - folded[0])
        meters.rejected.inc(out - folded[1])
        folded[:] = now + 1, out + 1  # (this fold's own next())
        while timings:
            meters.latency.observe(timings.pop())

    async def folding() -> None:
        await asyncio.sleep(WARM_S)
        while True:
            fold()
            await asyncio.sleep(FOLD_S)

    def metrics(_: wire.Request) -> wire.Response:
        fold()  # (prometheus_client imported by now)
        import prometheus_client as prom

        registry = prom.CollectorRegistry()
        prom.multiprocess.MultiProcessCollector(registry)
        registry.register(_StatusCollector(path, index))
        return wire.Response(prom.generate_latest(registry),
                             content_type=prom.CONTENT_TYPE_LATEST.encode())

    def admin(op: str):
        def handle(request: wire.Request):
            try:
                obj = orjson.loads(request.body)
            except orjson.JSONDecodeError as exc:
                return refuse("body", f"not JSON ({exc})")
            problem = registration_problem(obj, op)
            if problem is not None:
                return refuse(*problem)
            return _submitted(path, {**obj, "op": op})
        return handle

    def workers(_: wire.Request) -> wire.Response:
        return _json(workers_listed(read_status(path)))

    described = wire.Response(orjson.dumps(openapi.document(__version__)))

    routes = {
        "/openapi.json": {"GET": lambda _: described},
        "/v1/match": {"POST": match},
        "/healthz": {"GET": healthz},
        "/readyz": {"GET": readyz},
        "/metrics": {"GET": metrics},
        "/register": {"POST": admin("register")},  # engines at runtime (RFC #1403)
        "/unregister": {"POST": admin("unregister")},
        "/workers": {"GET": workers},
        "/query": {"POST": rfc_query(False)},
        "/query_by_hash": {"POST": rfc_query(True)},
    }
    probes = ("/healthz", "/readyz")
    routes = {p: {m: guarded(h, p in probes) for m, h in r.items()} for p, r in routes.items()}
    # The same answers, answered in C while a connection stays in the simple shape
    # routers send (wire.take); bodies from OFFLOAD_BYTES, and Valkey, stay beside.
    fast = {} if remote else {
        "POST /query": lambda body: rfc_answer(body, False),
        "POST /query_by_hash": lambda body: rfc_answer(body, True),
        "GET /healthz": lambda body: alive}
    return wire.Server(
        routes, max_body_bytes=MAX_BODY_BYTES, request_timeout_s=config.request_timeout_s,
        answer_timeout_s=config.answer_timeout_s, idle_timeout_s=config.idle_timeout_s,
        on_cut=lambda reason: meters.closed.labels(reason).inc(),
        too_large=lambda length: refuse("body", f"the body ({length} bytes) is over "
                                                f"{MAX_BODY_BYTES} bytes; send fewer hashes",
                                        413, close=True),
        fast={key: guarded(h, key.endswith("/healthz"), lambda body, auth: auth)
              for key, h in fast.items()}, fast_body_bytes=OFFLOAD_BYTES, chores=[folding])


async def _submitted(path: Path, command: dict) -> wire.Response:
    """A registration handed to the writer (:func:`submit`, a file exchange), off the
    event loop."""
    got = await asyncio.to_thread(submit, path, command)
    return _json(got["body"], got["status"])


def _json(obj, status: int = 200, close: bool = False) -> wire.Response:
    return wire.Response(orjson.dumps(obj), status, close=close)


def rfc_json(match, model: rfc.Model) -> bytes:
    """RFC #1403's answer as JSON: made in C from the match's rows, or the dict of
    :func:`sarp.serving.rfc.answer` encoded.  Cost: see :func:`rfc.answer_c`."""
    return rfc.answer_c(match, model) or orjson.dumps(rfc.answer(match, model))


_NOTHING = {"matched_blocks": 0, "instances": []}
_EMPTY_RFC = orjson.dumps(rfc.EMPTY)
# Bodies over this are worked on beside the event loop; up to it, on the loop (in C in
# routers' shape: wire.c takes bodies up to 1 MiB).  A /query of 1 MiB, 524,288 token
# ids, took 3-5 ms here; agentic contexts (median 176 kB) went 1.17x faster on the loop
# than with a thread hop each (docs/performance.md, issue 26).
OFFLOAD_BYTES = 1 << 20


def _answer(m, scores) -> dict:
    # orjson writes the InstanceScore dataclasses' fields itself, in their order
    return {"matched_blocks": m.num_blocks, "instances": scores}


class _StatusCollector:
    """``/metrics``' families from the writer's status file (:func:`status_metrics`), and
    index sizes from this reader."""

    def __init__(self, path: Path, index) -> None:
        self.path, self.index = path, index

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        for name, kind, text, labels, samples in status_metrics(read_status(self.path)):
            family = kinds[kind](name, text, labels=labels)
            for values, value in samples:
                family.add_metric(values, value)
            yield family
        stats = self.index.stats()
        for name in ("segments", "blocks", "directory_entries", "memory_bytes", "disk_bytes"):
            yield GaugeMetricFamily(f"sarp_index_{name}", f"index {name.replace('_', ' ')}",
                                    value=float(stats[name]))
