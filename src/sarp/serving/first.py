"""The first answers' child (forked by :mod:`sarp.serving.early`, which says what it is
for and how it hands over): the index loaded without numpy (the snapshot mapped and
checked, the log after it replayed, the holder names and the models read), and
``/query`` answered in one C call (``rfc_query``) on an ``epoll`` loop over C
connections until serve says stop or is gone.  Imports: lmdb (through
:mod:`sarp.lmdb_env`) and the C extension, nothing else of the core.
"""

from __future__ import annotations

import bisect
import contextlib
import hmac
import json
import mmap
import os
import select
import signal
import socket
import struct
import threading
import time
from pathlib import Path

from .. import native
from .status import STATUS_FILE, read_status, readiness, workers_listed

MAX_CONNECTIONS = 256  # open at once; more are closed as they come
MAX_BODY_BYTES = 1 << 20  # a larger /query is the workers' (503 here)
DRAIN_S = 0.5  # once asked to stop: its open connections answered this long more
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
_LOG = struct.Struct("<IQ")  # a log entry: segment id, first hash (store.LOG_VALUE)
_STARTING = json.dumps({"error": "sarp serve is starting: this request is answered once its "
                        "HTTP workers are up (in well under a second); try again",
                        "field": "service"}).encode()
_UNAUTHORIZED = json.dumps({"error": "send the token of --http-token-file as "
                            "'Authorization: Bearer TOKEN'", "field": "Authorization"}).encode()


class Unusable(Exception):
    """The snapshot and the log do not make the index's state (the reason is the
    message)."""


class _Directory:
    """The snapshot's directory as ``rfc_query``'s walk probes it
    (``directory.Directory``'s shape): the entries the log added since, then those
    looked up before (:meth:`probe_dicts`), then a binary search of the mapped keys,
    less those the log removed."""

    def __init__(self, keys: memoryview, segs: memoryview) -> None:
        self.keys, self.segs = keys, segs
        self.added: dict[int, int] = {}
        self.removed: set[int] = set()
        self.hot: dict[int, int] = {}

    def lookup(self, first_hash: int) -> int | None:
        seg = self.added.get(first_hash)
        if seg is None:
            seg = self.hot.get(first_hash)
        if seg is not None or first_hash in self.removed:
            return seg
        i = bisect.bisect_left(self.keys, first_hash)
        if i < len(self.keys) and self.keys[i] == first_hash:
            seg = self.segs[i]
            if len(self.hot) < HOT_ENTRIES:
                self.hot[first_hash] = seg
            return seg
        return None

    def probe_dicts(self) -> tuple[dict, dict]:
        return self.added, self.hot

    def add(self, first_hash: int, seg_id: int) -> None:
        self.added[first_hash] = seg_id
        self.hot.pop(first_hash, None)

    def remove(self, first_hash: int, seg_id: int) -> None:
        """Drop the entry for ``first_hash`` if it names ``seg_id``."""
        if self.lookup(first_hash) == seg_id:
            self.added.pop(first_hash, None)
            self.hot.pop(first_hash, None)
            self.removed.add(first_hash)


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
    snapshot's directory caught up with the log, the holder names, the models;
    ``reading`` is the tuple ``rfc_query`` takes (``rfc.reading_of``'s shape).
    :class:`Unusable` when the snapshot and the log after it do not make the store's
    state (another index's snapshot, a log trimmed past it, a hole)."""

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
        self.tables = {n: self.env.open_db(n, create=False)
                       for n in (b"segments", b"meta", b"holders", b"log")}
        self.meta = self.tables[b"meta"]
        self._view = _snapshot(folder / SNAPSHOT_FILE)
        _, _, _, index_id, watermark, n, _, _ = _HEADER.unpack_from(self._view)
        at = _HEADER.size
        self.directory = _Directory(self._view[at:at + 8 * n].cast("Q"),
                                    self._view[at + 8 * n:at + 12 * n].cast("I"))
        self._watermark = watermark
        with self.env.begin(db=self.meta) as txn:
            self.index_id = _bytes(txn.get(b"index_id"))
            if index_id != self.index_id:
                raise Unusable("the snapshot belongs to another index")
            self._names_of(txn)
            self.catch_up(txn, _counter(txn.get(b"next_seq")))
        self.models = models_of(folder)
        self.current = True
        self.reading = (threading.Lock(), self.begin, {"db": self.tables[b"segments"]},
                        {"db": self.meta}, self, self, [], None)  # (None: through begin)

    def _names_of(self, txn) -> None:
        meta = self.meta
        self.names_seen = (_counter(txn.get(b"next_holder_id", db=meta)),
                           _counter(txn.get(b"holder_changes", db=meta)))
        self.holders = _Names(_holder_names(txn, self.tables[b"holders"],
                                            txn.get(b"name_sums", db=meta) is not None))

    def catch_up(self, txn, newest: int) -> None:
        """Bring the directory to ``txn``'s state from the log entries after the
        watermark (``recovery.replay_log``'s rules: a segment logged several times is
        read once; an entry whose id no longer starts with its hash goes).  Unusable for
        a log trimmed past the watermark, a hole, or a watermark ahead of the store.
        Cost: a log entry's read and a dict operation each, a record read per segment,
        their checks in one C call.
        """
        mark, directory = self._watermark, self.directory
        if not _counter(txn.get(b"log_trimmed_upto", db=self.meta)) <= mark <= newest:
            raise Unusable(f"the snapshot's watermark {mark} is not in the log")
        latest: dict[int, list[int]] = {}
        cursor, seq = txn.cursor(db=self.tables[b"log"]), mark
        if cursor.set_range(_U64_BE.pack(mark + 1)):
            for key, value in cursor:
                seq += 1
                if _U64_BE.unpack(key)[0] != seq or len(value) != _LOG.size:
                    raise Unusable(f"log entry {seq} is missing or damaged")
                seg_id, first_hash = _LOG.unpack(value)
                logged = latest.pop(seg_id, None) or []
                if first_hash not in logged:
                    logged.append(first_hash)
                latest[seg_id] = logged
        if seq < newest:
            raise Unusable(f"log entries {seq + 1}..{newest} are missing")
        segments = self.tables[b"segments"]
        # each record checked as recovery.replay checks it: one C call (segment.heads)
        firsts, states, _, _ = native.C.heads(
            [txn.get(_U64_BE.pack(seg_id), db=segments) for seg_id in latest])
        for (seg_id, logged), first, state in zip(latest.items(), memoryview(firsts).cast("Q"),
                                                  memoryview(states).cast("b"), strict=True):
            for first_hash in logged:
                if state <= 0 or first_hash != first:  # gone or damaged, or another chain
                    directory.remove(first_hash, seg_id)
            if state > 0:
                directory.add(first, seg_id)
        self._watermark = max(seq, newest)

    def close(self) -> None:
        self.env.close()

    def begin(self, db):
        """``rfc_query``'s transaction, with this memory caught up to it (the names read
        again when they changed, the log replayed since the watermark); a catch-up
        that fails (the log trimmed past it) leaves the child answering 503."""
        txn = self.env.begin(db=db)
        if self.current:
            try:
                meta = self.meta
                if (_counter(txn.get(b"next_holder_id", db=meta)),
                        _counter(txn.get(b"holder_changes", db=meta))) != self.names_seen:
                    self._names_of(txn)
                newest = _counter(txn.get(b"next_seq", db=meta))
                if newest != self._watermark:
                    self.catch_up(txn, newest)
            except Exception:  # noqa: BLE001 - nothing more is answered here
                self.current = False
        return txn

    @property
    def watermark(self) -> int:
        """The log sequence this memory reflects; -1 once a catch-up failed (C reads it
        as unsigned, fails, and declines: the child answers 503 from then on)."""
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
    except Exception:  # noqa: BLE001 - no snapshot the log reaches: the workers answer
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
