"""serve's first milliseconds: ``POST /query`` answered from the index on disk, and the
engines followed, before numpy, the core and the HTTP stack are imported.

A restarted ``sarp serve --http`` refused connections for its first 0.2-0.25 s (its
workers answer once Python has imported numpy, the core and the HTTP stack, and the
workers are forked), and its engines' batches of that time were lost until its
subscriber connected, then replayed (docs/performance.md).  Now the command line
(:func:`start`, at the top of ``cli.main``, before anything else is imported):

* binds the HTTP listener and forks a child that imports only lmdb (through
  :mod:`sarp.lmdb_env`) and the C extension.  The child maps the directory snapshot
  and checks it, reads the holder names and the models the last serve's status file
  named, and answers each ``/query`` in one C call (``rfc_query``: the workers' own
  fast path, byte for byte their answer) on an ``epoll`` loop over C connections
  (``wire.c``'s ``Conn``);
* then connects a SUB socket to each engine that status file names
  (:func:`connect_engines`): the engines publish to serve while it imports, and its
  subscriber adopts the sockets with what queued in them.

The child answers only while what it loaded is the index's state: the snapshot
covers the log (its watermark is the store's next sequence, its index id the
store's) and no holder changed since.  Once the new writer commits, and for any
request C leaves to the workers' general path (another route or shape, a LoRA
adapter, a model the status file did not name, no full block, a walk C hands back,
a damaged record), it answers 503 with ``Retry-After: 1`` and a JSON error naming
``service``.  ``GET /healthz`` is 200 (the child is alive), ``GET /readyz`` 503
(readiness is the workers' to report), ``GET /workers`` the status file's engines;
the bearer token of ``--http-token-file`` is asked for as the workers ask for it.
Without a snapshot of the store's state (a first start; a crash while engines
published, before serve's next snapshot), a Valkey index or shards, or without the
C extension, there is no child and the workers answer from their start, as before.

The hand-over: one process accepts at a time.  When every worker's loop has stamped
its heartbeat, serve's dealer (``workers.ConnectionDealer``) asks the child to stop
(a byte on their socket pair) and accepts as soon as the child says it no longer
does (at most ``STOP_S``, then SIGKILL); connections that came meanwhile wait in the
listener's queue, and the child answers what its open connections still ask for up
to ``DRAIN_S``, each answer closing its connection.  The child leaves when serve's
process is gone too.  Its bounds: ``MAX_CONNECTIONS`` open connections (more are
closed as they come), bodies up to ``MAX_BODY_BYTES``, and serve's
``--http-request-timeout-s`` and ``--http-idle-timeout-s``.

Cost: a listener and a fork in the command line (about 1 ms); in the child, about
20 ms of imports and a pass of xxh3 over the snapshot file; ZeroMQ's import (about
25 ms) and two sockets an engine in serve.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import hmac
import json
import logging
import mmap
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

from .. import native
from .access import access_token, parse_address
from .status import STATUS_FILE, read_status, readiness, workers_listed

MAX_CONNECTIONS = 256  # open at once; more are closed as they come
MAX_BODY_BYTES = 1 << 20  # a larger /query is the workers' (503 here)
STOP_S = 1.0  # the child's time to stop accepting once asked, then SIGKILL
DRAIN_S = 0.5  # ... and to answer what its open connections ask meanwhile
SWEEP_S = 0.1  # time bounds and serve's life checked this often
HOT_ENTRIES = 1 << 16  # directory lookups remembered (directory.HOT_ENTRIES)
# as tokenkeys.SEED, tokenkeys.DEFAULT_TENANT and rfc.MAX_QUERY_BLOCKS (those modules
# import numpy; tests/test_early.py holds them equal)
SEED = 1337
DEFAULT_TENANT = "default"
MAX_QUERY_BLOCKS = 1 << 18
SNAPSHOT_FILE = "directory.snap"  # as snapshot.SNAPSHOT_FILE, whose layout is read here
_HEADER = struct.Struct("<8sII16sQQQQ")
_U64_BE = struct.Struct(">Q")
_STARTING = json.dumps({"error": "sarp serve is starting: this request is answered once its "
                        "HTTP workers are up (in well under a second); try again",
                        "field": "service"}).encode()
_UNAUTHORIZED = json.dumps({"error": "send the token of --http-token-file as "
                            "'Authorization: Bearer TOKEN'", "field": "Authorization"}).encode()


class Unusable(Exception):
    """What the child loaded is not the index's state (the reason is the message)."""


class FirstAnswers:
    """serve's side of the child (see the module): the listener it bound, the child's
    pid and their socket pair.  :meth:`listener_for` hands the listener to the dealer;
    :meth:`stop` ends the child (the dealer's, once the workers run)."""

    def __init__(self, listener: socket.socket, host: str, port: int, pid: int,
                 control: socket.socket) -> None:
        self.listener, self.host, self.port = listener, host, port
        self.pid, self.control = pid, control
        self._lock = threading.Lock()

    def listener_for(self, host: str, port: int) -> socket.socket | None:
        """The listener, if it is bound where serve would bind (else the child is
        stopped and the listener closed: the dealer binds its own)."""
        if (host, port) == (self.host, self.port):
            return self.listener
        self.stop()
        self.listener.close()
        return None

    def stop(self) -> None:
        """Ask the child to stop accepting, and return once it has (or has exited, or
        after ``STOP_S``: then SIGKILL); the listener is blocking again, for the
        dealer.  The child answers what its open connections still ask for up to
        ``DRAIN_S`` more, and a thread of ours reaps it.  Idempotent."""
        with self._lock:
            if self.pid == 0:
                return
            pid, self.pid = self.pid, 0
            with contextlib.suppress(OSError):
                self.control.settimeout(STOP_S)
                self.control.send(b"s")
                if self.control.recv(1) == b"k":  # (b"": it exited)
                    threading.Thread(target=_reap, args=(pid, DRAIN_S + STOP_S),
                                     name="sarp-first-answers", daemon=True).start()
                    pid = 0
            if pid:
                _reap(pid, 0.0)
            self.control.close()
            if self.listener.fileno() >= 0:
                self.listener.setblocking(True)

    def sockets(self) -> list[socket.socket]:
        """What a process forked after this one must close (the zygote)."""
        return [self.listener, self.control]


class Early:
    """What :func:`start` made before serve's imports: the first answers' child (or
    None) and the engines' SUB sockets, already connected (``endpoint -> (socket,
    monitor)``, made with ``max_frame_bytes``), for serve to take."""

    def __init__(self, answers: FirstAnswers | None, engines: dict, max_frame_bytes: int
                 ) -> None:
        self.answers, self.engines, self.max_frame_bytes = answers, engines, max_frame_bytes

    def take_engines(self, max_frame_bytes: int) -> dict:
        """The engines' sockets, handed over (they were made with this
        ``max_frame_bytes``; else closed, and {}): nothing of them stays here."""
        engines, self.engines = self.engines, {}
        if max_frame_bytes != self.max_frame_bytes:
            close_engines(engines)
            return {}
        return engines

    def close(self) -> None:
        """Stop the child; close the sockets serve did not take.  Idempotent."""
        if self.answers is not None:
            self.answers.stop()
        close_engines(self.take_engines(-1))


def close_engines(engines: dict) -> None:
    """Close each (socket, monitor) of ``engines``; it is empty after."""
    for sock, monitor in engines.values():
        monitor.close(linger=0)
        sock.close(linger=0)
    engines.clear()


def start(argv: list[str]) -> Early | None:
    """For ``sarp serve ARGS`` (``argv``: the ARGS), before anything but the command
    line's own modules is imported, on an index folder a serve left: when serve
    answers HTTP and a snapshot is there, bind the listener and fork the first
    answers' child; then connect to the engines the last serve's status file named,
    so that they publish to serve while it imports (their batches wait in ZeroMQ's
    queues).  None when there is nothing to do; serve then starts as before, and its
    own parse says what is wrong with its flags.

    Only flags spelled out in full are read here; anything unexpected means nothing
    is done early.
    """
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--index", "--http", "--http-token-file", "--shard", "--max-frame-bytes",
                 "--http-request-timeout-s", "--http-idle-timeout-s"):
        p.add_argument(flag)
    p.add_argument("--http-allow-unauthenticated", action="store_true")
    try:
        args, _ = p.parse_known_args(argv)
        if not args.index or args.shard or "://" in args.index \
                or not (Path(args.index) / STATUS_FILE).is_file():
            return None
        max_frame_bytes = int(args.max_frame_bytes or 64 << 20)
    except (SystemExit, ValueError):
        return None
    answers = _fork_answers(args) if args.http else None
    return Early(answers, connect_engines(Path(args.index), max_frame_bytes), max_frame_bytes)


def _fork_answers(args) -> FirstAnswers | None:
    try:
        if native.C is None or sys.byteorder != "little" \
                or not (Path(args.index) / SNAPSHOT_FILE).is_file():
            return None
        host, port = parse_address(args.http)
        logging.disable(logging.WARNING)  # (serve says it, once its logging is set up)
        try:
            token = access_token(args.http, args.http_token_file,
                                 args.http_allow_unauthenticated)
        finally:
            logging.disable(logging.NOTSET)
        request_s = float(args.http_request_timeout_s or 10.0)
        idle_s = float(args.http_idle_timeout_s or 30.0)
        if not (0 < request_s < 1e6 and 0 < idle_s < 1e6):
            return None
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        listener = socket.create_server((host, port), family=family, backlog=1024)
    except (ValueError, OSError):  # serve's parse and dealer say it properly
        return None
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            ours.close()
            serve_first(listener, theirs, Path(args.index), token, request_s, idle_s,
                        os.getppid())
        except BaseException:  # noqa: BLE001 - the workers answer instead; nothing to say
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    return FirstAnswers(listener, host, port, pid, ours)


def sub_socket(ctx, endpoint: str, max_frame_bytes: int) -> tuple:
    """An engine's SUB socket as serve follows it (everything subscribed, nothing
    dropped on our side, frames over ``max_frame_bytes`` refused) and its monitor
    (connects and disconnects), connected to ``endpoint``.  ``zmq.ZMQError`` when out
    of sockets (nothing left open)."""
    import zmq

    opened = []
    try:
        opened.append(sock := ctx.socket(zmq.SUB))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        opened.append(monitor := sock.get_monitor_socket(zmq.EVENT_CONNECTED
                                                         | zmq.EVENT_DISCONNECTED))
        sock.connect(endpoint)
    except zmq.ZMQError:
        for s in opened:
            s.close(linger=0)
        raise
    return sock, monitor


def zmq_context(ctx=None):
    """``ctx``, or serve's ZeroMQ context (the process's), with room for as many sockets
    as the system allows (ZeroMQ's default, 1,023, held about 250 engines; effective
    before the context's first socket)."""
    import zmq

    ctx = ctx or zmq.Context.instance()
    ctx.set(zmq.MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT))
    return ctx


def connect_engines(folder: Path, max_frame_bytes: int) -> dict[str, tuple]:
    """SUB sockets (and monitors) connected to each endpoint the status file in
    ``folder`` lists; as many as the process may open.  Cost: ZeroMQ's import (about
    25 ms) and two sockets an engine."""
    try:
        engines = json.loads((folder / STATUS_FILE).read_text()).get("engines", [])
        endpoints = sorted({e["endpoint"] for e in engines if isinstance(e, dict)
                            and isinstance(e.get("endpoint"), str)})
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    if not endpoints:
        return {}
    import zmq

    ctx, out = zmq_context(), {}
    for endpoint in endpoints:
        try:
            out[endpoint] = sub_socket(ctx, endpoint, max_frame_bytes)
        except zmq.ZMQError:  # out of sockets, or an endpoint ZeroMQ refuses: serve's
            continue
    return out


def _reap(pid: int, within_s: float) -> None:
    """Wait up to ``within_s`` for the child to exit, then SIGKILL it; reaped."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                time.sleep(0.005)
                continue
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


class _Directory:
    """The snapshot's directory as ``rfc_query``'s walk probes it: no recent changes,
    and the entries looked up before (``Directory.probe_dicts``), then a binary search
    of the mapped keys."""

    def __init__(self, keys: memoryview, segs: memoryview) -> None:
        self.keys, self.segs, self.hot = keys, segs, {}

    def lookup(self, first_hash: int) -> int | None:
        i = bisect.bisect_left(self.keys, first_hash)
        if i < len(self.keys) and self.keys[i] == first_hash:
            seg = self.segs[i]
            if len(self.hot) < HOT_ENTRIES:
                self.hot[first_hash] = seg
            return seg
        return None

    def probe_dicts(self) -> tuple[dict, dict]:
        return {}, self.hot


class _Names:
    __slots__ = ("names",)

    def __init__(self, names: dict[int, tuple[str, str]]) -> None:
        self.names = names


class _Model:
    """What ``rfc_query`` reads of a model (``rfc.Model``)."""

    __slots__ = ("block_size", "root", "ranks")

    def __init__(self, block_size: int, root: int) -> None:
        self.block_size, self.root, self.ranks = block_size, root, {}


class Loaded:
    """The index as the child answers from it: the environment (readonly), the
    snapshot's directory, the holder names, the models; ``reading`` is the tuple
    ``rfc_query`` takes (``rfc.reading_of``'s shape).  :class:`Unusable` when the
    snapshot is not the store's state."""

    def __init__(self, folder: Path) -> None:
        from .. import folder as folders
        from .. import lmdb_env

        folders.check_readable(folder)
        folders.check_data_file(folder / "data.mdb")
        self.env = lmdb_env.open_env(str(folder), readonly=True)
        try:
            self._load(folder)
        except lmdb_env.Error as exc:
            self.close()
            raise Unusable(f"{folder}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _load(self, folder: Path) -> None:
        tables = {n: self.env.open_db(n, create=False)
                  for n in (b"segments", b"meta", b"holders")}
        self.meta = tables[b"meta"]
        with self.env.begin(db=self.meta) as txn:
            self.index_id = _bytes(txn.get(b"index_id"))
            self.next_seq = _counter(txn.get(b"next_seq"))
            self.names_seen = self._names_version(txn)
            sums_required = txn.get(b"name_sums") is not None
            names = _holder_names(txn, tables[b"holders"], sums_required)
        self._view = _snapshot(folder / SNAPSHOT_FILE)
        magic, version, _, index_id, watermark, n, _, _ = _HEADER.unpack_from(self._view)
        if index_id != self.index_id or watermark != self.next_seq:
            raise Unusable("the snapshot is not the store's state (a commit after it)")
        at = _HEADER.size
        self._watermark = watermark
        self.directory = _Directory(self._view[at:at + 8 * n].cast("Q"),
                                    self._view[at + 8 * n:at + 12 * n].cast("I"))
        self.holders = _Names(names)
        self.models = models_of(folder)
        self.current = True
        self.reading = (threading.Lock(), self.begin, {"db": tables[b"segments"]},
                        {"db": self.meta}, self, self, [])

    @staticmethod
    def _names_version(txn, db=None) -> tuple[int, int]:  # holders.names_version
        kw = {} if db is None else {"db": db}
        return (_counter(txn.get(b"next_holder_id", **kw)),
                _counter(txn.get(b"holder_changes", **kw)))

    def close(self) -> None:
        self.env.close()

    def begin(self, db):
        """``rfc_query``'s transaction; what it sees of the store decides, once and for
        all, whether this memory is still the store's state."""
        txn = self.env.begin(db=db)
        if self.current and (_counter(txn.get(b"next_seq", db=self.meta)) != self.next_seq
                             or self._names_version(txn, self.meta) != self.names_seen):
            self.current = False
        return txn

    @property
    def watermark(self) -> int:
        """The snapshot's watermark while current; -1 after (C reads it as unsigned,
        fails, and declines: the child answers 503 from then on)."""
        return self._watermark if self.current else -1


def _bytes(value) -> bytes:
    return b"" if value is None else bytes(value)


def _counter(value) -> int:  # store.counter_value: 8 bytes BE, absent 0
    return 0 if value is None else _U64_BE.unpack(value)[0]


def _snapshot(path: Path) -> memoryview:
    """The snapshot file mapped, its magic, version, size and checksum checked
    (``snapshot.decode``'s checks)."""
    with open(path, "rb") as f:
        view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    if len(view) < _HEADER.size + 8:
        raise Unusable(f"{path}: too short")
    magic, version, _, _, _, n, holder_bytes, _ = _HEADER.unpack_from(view)
    end = _HEADER.size + 8 * n + ((4 * n + 7) & ~7) + holder_bytes
    if magic != b"SARPSNAP" or version != 1 or end + 8 != len(view):
        raise Unusable(f"{path}: not a snapshot this sarp reads")
    if native.C.xxh3_64(view[:end]) != struct.unpack_from("<Q", view, end)[0]:
        raise Unusable(f"{path}: checksum mismatch")
    return view


def _holder_names(txn, db, sums_required: bool) -> dict[int, tuple[str, str]]:
    """Holder id -> (instance, medium), the names that pass their checksums
    (``store.holder_names`` and ``holders.Holders``: a damaged name is left out)."""
    out = {}
    cursor = txn.cursor(db=db)
    if not cursor.set_range(b"i:"):
        return out
    for key, value in cursor:
        if not key.startswith(b"i:"):
            break
        if len(key) != 4:
            continue
        stored, name = txn.get(b"s:" + key[2:], db=db), bytes(value)
        ok = (bytes(stored) == native.C.xxh3_64(b"sarp-holder:" + name).to_bytes(8, "big")
              if stored is not None else not sums_required)
        if ok and b"\0" in name:
            with contextlib.suppress(UnicodeDecodeError):
                instance, medium = name.decode().split("\0", 1)
                out[struct.unpack(">H", key[2:])[0]] = (instance, medium)
    return out


def models_of(folder: Path) -> dict[tuple[str, str], _Model]:
    """``rfc.models_of`` the engines of the status file the last serve left (the
    models a query may name, their block sizes and ranks); {} without one."""
    try:
        engines = json.loads((folder / STATUS_FILE).read_text()).get("engines", [])
    except (OSError, ValueError, AttributeError):
        return {}
    out: dict[tuple[str, str], _Model] = {}
    for e in engines if isinstance(engines, list) else []:
        with contextlib.suppress(AttributeError, KeyError, TypeError, ValueError):
            if e.get("model") is None or not e.get("block_size"):
                continue
            tenant = e.get("tenant") or DEFAULT_TENANT
            model = out.get((e["model"], tenant))
            if model is None:
                root = native.C.xxh3_64(f"sarp-model\0{e['model']}\0{tenant}".encode())
                model = out[e["model"], tenant] = _Model(int(e["block_size"]), root)
            rank = e.get("dp_rank") or 0
            model.ranks[f"{e['name']}#{rank}"] = (e["name"], rank)
    return out


class _Answer:
    """A non-200 answer of the child's, framed by :meth:`_Side.frame`."""

    __slots__ = ("status", "body", "close")

    def __init__(self, status: int, body: bytes, close: bool = True) -> None:
        self.status, self.body, self.close = status, body, close


_REASONS = {200: b"OK", 401: b"Unauthorized", 503: b"Service Unavailable"}


def frame(answer: _Answer, close: bool) -> bytes:
    head = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % (
        answer.status, _REASONS.get(answer.status, b"-"), len(answer.body))
    if answer.status == 503:
        head += b"Retry-After: 1\r\n"
    return head + (b"Connection: close\r\n\r\n" if close else b"\r\n") + answer.body


class _Side:
    """What a C connection calls back (``wire._Side``'s three calls): here a request
    outside the fast subset is answered 503 and the connection closed."""

    def __init__(self, conns: dict, poller) -> None:
        self.conns, self.poller = conns, poller

    def release(self, conn, fd: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.poller.unregister(fd)
        self.conns.pop(fd, None)

    def hand_over(self, fd: int, rest: bytes, out: bytes, linger: bool) -> None:
        """The answers C framed and has not sent (``out``), then a 503 for the request
        C does not take (at the head of ``rest``, if any); the connection closes."""
        sock = socket.socket(fileno=fd)
        with contextlib.suppress(OSError), sock:
            sock.settimeout(0.2)  # (this connection's own; a client that reads nothing)
            sock.sendall(out + (frame(_Answer(503, _STARTING), True) if rest else b""))

    @staticmethod
    def frame(answer: _Answer, close: bool = False) -> tuple[bytes, bool]:
        close = close or answer.close
        return frame(answer, close), close


def serve_first(listener: socket.socket, control: socket.socket, folder: Path,
                token: str | None, request_s: float, idle_s: float, parent: int) -> None:
    """The child's life: load, then answer until serve says stop or is gone.  A load
    that fails returns at once (nothing was accepted: the workers answer it all)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # serve stops us (a Ctrl-C hits both)
    try:
        loaded = Loaded(folder)
    except Exception:  # noqa: BLE001 - no snapshot of this state: the workers answer
        return
    c, models, reading = native.C, loaded.models, loaded.reading
    bearer = None if token is None else b"Bearer " + token.encode()
    starting, unauthorized = _Answer(503, _STARTING), _Answer(401, _UNAUTHORIZED, False)

    closing = [False]  # draining: every answer closes its connection

    def query(body: bytes, authorization: bytes | None):
        if bearer is not None and not hmac.compare_digest(authorization or b"", bearer):
            return unauthorized
        got = None if not loaded.current else c.rfc_query(
            body, models, DEFAULT_TENANT, SEED, MAX_QUERY_BLOCKS, reading)
        if got is None:
            return starting
        return _Answer(200, got) if closing[0] else got

    def guarded(handler):
        def handle(body: bytes, authorization: bytes | None):
            if bearer is not None and not hmac.compare_digest(authorization or b"", bearer):
                return unauthorized
            return handler(body)
        return handle

    alive = json.dumps({"status": "alive", "pid": os.getpid()}).encode()
    # never ready: readiness is the workers' (a killed serve's status may say caught up)
    unready = _Answer(503, json.dumps(readiness(None)).encode(), False)
    poller = select.epoll()
    conns: dict[int, object] = {}
    side = _Side(conns, poller)
    routes = {b"POST /query": query, b"GET /healthz": lambda body, auth: alive,
              b"GET /readyz": lambda body, auth: unready,
              b"GET /workers": guarded(lambda body: json.dumps(
                  workers_listed(read_status(folder))).encode())}
    listener.setblocking(False)  # (the dealer makes it blocking again: FirstAnswers.stop)
    poller.register(listener.fileno(), select.EPOLLIN)
    poller.register(control.fileno(), select.EPOLLIN)
    swept, draining = time.monotonic(), 0.0
    while conns or not draining:
        for fd, _ in poller.poll(SWEEP_S):
            if fd == control.fileno() and not draining:
                # stop: accept no more, say so (the dealer accepts from then on), and
                # answer what the open connections ask for a while, each closed after
                poller.unregister(listener.fileno())
                poller.unregister(control.fileno())
                with contextlib.suppress(OSError):
                    control.send(b"k")
                draining = time.monotonic()
                closing[0] = True
            elif fd == listener.fileno():
                _accept(listener, conns, poller, routes, side, request_s, idle_s)
            elif (conn := conns.get(fd)) is not None:
                conn.readable()
        now = time.monotonic()
        if now - swept >= SWEEP_S or draining:
            swept = now
            if os.getppid() != parent or (draining and now - draining > DRAIN_S):
                break  # serve is gone, or the drain's time is up
            for conn in list(conns.values()):
                if conn.expired(now) is not None:
                    conn.abort()
    for conn in list(conns.values()):
        conn.abort()


def _accept(listener, conns: dict, poller, routes: dict, side: _Side, request_s: float,
            idle_s: float) -> None:
    for _ in range(64):
        try:
            sock, _ = listener.accept()
        except OSError:  # none left (or out of descriptors: the next turn tries again)
            return
        if len(conns) >= MAX_CONNECTIONS:
            sock.close()
            continue
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        fd = sock.detach()
        try:
            conns[fd] = native.C.Conn(fd, routes, side, request_s, idle_s, MAX_BODY_BYTES)
            poller.register(fd, select.EPOLLIN)
        except BaseException:
            conns.pop(fd, None)
            os.close(fd)
            raise
