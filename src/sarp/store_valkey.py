"""sarp on Valkey: the store's tables as keys of one namespace, shared by many machines.

``sarp.open("valkey://HOST:PORT/NAMESPACE")`` (also ``redis://``, and ``rediss://`` or
``valkeys://`` with TLS; a password in the URL or in ``$SARP_VALKEY_PASSWORD``) gives
the same :class:`sarp.Index` as a folder does, with this module in place of
:mod:`sarp.store_lmdb` (both implement :mod:`sarp.store`'s contract).  Every key of a
namespace carries the hash tag ``{NAMESPACE}``, so all of them live in one slot of a
Valkey cluster and every write is one atomic transaction on one node::

    sarp:{NS}:meta    HASH   counters and identity (the LMDB meta table's keys/values)
    sarp:{NS}:seg     HASH   segment id (u64 BE) -> segment record
    sarp:{NS}:blk     HASH   block hash (u64 BE) -> (u32 segment id, u16 offset) LE
    sarp:{NS}:hold    HASH   holder names, both ways, with checksums
    sarp:{NS}:log     STREAM entry ID "<seq>-1", field v = (u32 segment id, u64 first hash)
    sarp:{NS}:snap    STRING the directory snapshot (:mod:`sarp.snapshot`'s bytes)
    sarp:{NS}:lease   STRING "<fence>:<token>" of the one writer, with a TTL
    sarp:{NS}:fence   STRING counter: the fencing token of each lease taken
    sarp:{NS}:state:NAME  STRING  small state kept with the index (``subscriber.json``)

**One writer, fenced.**  A writer takes the lease with ``SET NX PX`` and a fence from
``INCR``; a thread renews it every third of its time.  Every write (a whole insert,
remove, clear or batch) is one ``MULTI``/``EXEC`` of its changes and log entries, sent
after a ``WATCH`` of the lease and a read that it still holds this writer's value
(:meth:`ValkeyStore.transact`): all or nothing, and a writer that was paused past its
lease (another took over, or nobody did) can never write again
(:class:`sarp.LeaseLostError`).  Readers keep their directory current
by reading the log stream past their watermark, as LMDB readers read the log table.

Cost: a match makes one round trip per segment step (``HGET``); a write a few round
trips to read what it changes, then two to commit.  This module is the only one that
imports the valkey client.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import valkey

from . import resp
from . import snapshot as snapshots
from .errors import (
    IndexLockedError,
    LeaseLostError,
    NotAnIndexError,
    StoreError,
    StoreFullError,
)
from .store import (
    check_durability,
    check_version,
    counter_value,
    parse_url,
)
from .valkey_read import CAPABILITIES, ValkeyReadTxn
from .valkey_scripts import READ, RENEW, SET, ReadAhead
from .valkey_write import ValkeyWriteTxn

log = logging.getLogger("sarp.valkey")

DEFAULT_LEASE_S = 10.0
TRANSACT_TRIES = 5  # EXECs refused in a row (the lease renewed meanwhile) before giving up
# the errors by which the client says the server cannot be reached
UNREACHABLE = (valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError)
T = TypeVar("T")
_MOVED = (valkey.exceptions.MovedError, valkey.exceptions.AskError,
          valkey.exceptions.TryAgainError, valkey.exceptions.ClusterDownError)
_MOVED_WORDS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")  # (as a node's plain reply)


def connect(settings: dict):
    """A client for :func:`parse_url`'s settings: a cluster client when the server is
    in cluster mode.  Cost: one round trip (``INFO cluster``)."""
    kwargs = {"host": settings["host"], "port": settings["port"],
              "username": settings["username"], "password": settings["password"],
              "ssl": settings["ssl"], "socket_timeout": 10.0, "socket_connect_timeout": 5.0}
    client = valkey.Valkey(**kwargs)
    if int(client.info("cluster").get("cluster_enabled", 0)):
        client.close()
        from valkey.cluster import ValkeyCluster

        return ValkeyCluster(**kwargs)
    return client


class ValkeyStore:
    """:class:`sarp.store.Store` on a Valkey namespace (see the module)."""

    # every read is a round trip: a match fetches its predicted records in one
    capabilities = CAPABILITIES
    maybe_applied = False  # set by a write that got no answer (see Store)

    def __init__(self, url: str, *, durability: str = "sync", create: bool = True,
                 readonly: bool = False, lease_s: float = DEFAULT_LEASE_S,
                 wait_for_lease_s: float = 0.0) -> None:
        check_durability(durability)
        for name, value, low in (("lease_s", lease_s, 0.1), ("wait_for_lease_s",
                                                             wait_for_lease_s, 0.0)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    low <= value <= 3600):
                raise ValueError(f"{name}={value!r}; pass seconds from {low} to 3600")
        self.settings = parse_url(url)
        self.path = url  # what messages name
        self.durability = durability
        self.readonly = readonly
        self.lease_ms = int(lease_s * 1000)
        ns = self.settings["namespace"]
        self.keys = {name: f"sarp:{{{ns}}}:{name}".encode()
                     for name in ("meta", "seg", "blk", "hold", "alias", "log", "snap", "lease",
                                  "fence")}
        self._lease_value: bytes | None = None
        self._lease_until = 0.0  # monotonic time the lease runs out, as of its last renewal
        self._aof = False
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._match_conn = None
        self._ahead = ReadAhead(self.keys["meta"], self.keys["seg"])  # one sent on it
        self.read_head = self._ahead.head  # READ after its count (valkey_read.c packs it)
        self.exec_refused = 0  # commits the server turned away (the lease key changed)
        # what the server has of `blocks`, as this writer's commits left it, and the
        # next_seq they left (valkey_write.ValkeyWriteTxn.remember)
        self.known_blocks = None
        self.known_seq: bytes | None = None
        try:
            self.client = connect(self.settings)
            self._aof = durability == "sync" and _aof_enabled(self.client)
            self._set = self.client.register_script(SET)
            self._renew = self.client.register_script(RENEW)
            self._read_script = self.client.register_script(READ)
            exists = self.client.hget(self.keys["meta"], b"format_version") is not None
            if not exists and (readonly or not create):
                raise NotAnIndexError(
                    f"{url}: no sarp index in namespace {ns!r}; open it once without "
                    "readonly=True (and with create=True) to create it")
            if not readonly:
                self._take_lease(wait_for_lease_s)
                if not exists:
                    self._create()
            check_version(self.client.hget(self.keys["meta"], b"format_version"), self.path)
            self.index_id = bytes(self.client.hget(self.keys["meta"], b"index_id"))
        except UNREACHABLE as exc:
            self.close()
            how = " over TLS" if self.settings["ssl"] else ""
            raise StoreError(f"{url}: cannot reach Valkey{how} ({exc}); is the server up"
                             f"{', and serving TLS' if how else ''}?") from exc
        except valkey.exceptions.ValkeyError as exc:
            self.close()
            raise _refused(url, "opening", exc) from exc
        except BaseException:
            self.close()
            raise

    # -- the lease ---------------------------------------------------------------------------

    def _take_lease(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fence = self.client.incr(self.keys["fence"])
                value = f"{fence}:{uuid.uuid4().hex}".encode()
                asked = time.monotonic()  # the server sets it at this time or later
                taken = self.client.set(self.keys["lease"], value, nx=True, px=self.lease_ms)
            except UNREACHABLE as exc:
                if time.monotonic() >= deadline:
                    raise
                # a stalled or restarting server: a standby waits it out (it gave up here)
                log.warning("sarp: %s: Valkey did not answer while waiting for the lease "
                            "(%s); trying again", self.path, exc)
                time.sleep(0.2)
                continue
            if taken:
                self._lease_value = value
                self._lease_until = asked + self.lease_ms / 1000
                break
            if time.monotonic() >= deadline:
                holder = self.client.get(self.keys["lease"])
                ttl = self.client.pttl(self.keys["lease"])
                raise IndexLockedError(
                    f"{self.path}: another writer holds the lease ({holder!r}, {ttl} ms "
                    "left); open readonly=True to read beside it, or pass wait_for_lease_s "
                    "to take over when it stops renewing")
            time.sleep(min(0.05, self.lease_ms / 20000))
        self._renewer = threading.Thread(target=self._keep_lease, name="sarp-lease",
                                         daemon=True)
        self._renewer.start()

    def _keep_lease(self) -> None:
        while not self._stop.wait(self.lease_ms / 3000):
            asked = time.monotonic()
            try:
                held = self._renew(keys=[self.keys["lease"]],
                                   args=[self._lease_value, self.lease_ms])
            except valkey.exceptions.ValkeyError as exc:
                log.warning("sarp: renewing the lease of %s failed: %s", self.path, exc)
                continue
            if not held:
                log.error("sarp: %s: the writer lease was lost; writes are refused",
                          self.path)
                self._lost.set()
                return
            self._lease_until = asked + self.lease_ms / 1000

    def _check_lease(self) -> None:
        if not self._lost.is_set() and time.monotonic() > self._lease_until:
            # not renewed within its time (the server stalled, or this process did): the
            # server has let it go, and another writer may hold it now
            self._lost.set()
        if self._lost.is_set():
            raise LeaseLostError(f"{self.path}: this writer lost its lease (another writer "
                                 "took over, or it was paused past the lease); reopen")

    def _create(self) -> None:
        w = ValkeyWriteTxn(self)
        w.create_meta()
        w.commit()

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
            self._renewer = None
        client = getattr(self, "client", None)
        if client is not None:
            # Valkey may be gone: what is unreleased expires with the lease
            with contextlib.suppress(valkey.exceptions.ValkeyError):
                if self._lease_value is not None and not self._lost.is_set():
                    self._renew(keys=[self.keys["lease"]], args=[self._lease_value, 0])
            self.drop_match_connection()
            with contextlib.suppress(valkey.exceptions.ValkeyError):
                client.close()
            self.client = None
        self._lease_value = None

    def release_dead_readers(self) -> int:
        """Nothing to free: Valkey readers hold no slot."""
        return 0

    def disk_bytes(self) -> int:
        """Bytes the namespace's keys take in the server (``MEMORY USAGE``)."""
        return sum(self.client.memory_usage(key) or 0 for key in self.keys.values())

    def memory_bytes(self) -> int:
        """Nothing between writes (a write's tables live as long as it does)."""
        return 0

    # -- transactions ------------------------------------------------------------------------

    def read(self) -> ValkeyReadTxn:
        return ValkeyReadTxn(self)

    def write(self, fn: Callable[[ValkeyWriteTxn], T]) -> T:
        """Run ``fn`` on a buffered write and commit it in one fenced transaction
        (:meth:`transact`); all or nothing."""
        self._check_lease()
        w = ValkeyWriteTxn(self)
        try:
            try:
                result = fn(w)
            except UNREACHABLE as exc:
                self._check_lease()  # the lease ran out meanwhile: say that, not a timeout
                raise StoreError(f"{self.path}: write failed ({exc}); nothing was "
                                 "written") from exc
            except valkey.exceptions.ValkeyError as exc:
                raise _refused(self.path, "writing (nothing was written)", exc) from exc
            w.commit()
        except BaseException:
            self.known_blocks = None  # (the server may have restarted, or the commit landed)
            raise
        w.remember()
        return result

    def counter(self, name: str) -> int:
        with ValkeyReadTxn(self):  # its exit turns Valkey's errors into StoreError
            raw = self.client.hget(self.keys["meta"], name.encode())
        return counter_value(raw, name, self.path)

    def hmget(self, key: bytes, fields: list[bytes]) -> list:
        """``HMGET`` on the match path's connection (:meth:`_on_match_conn`)."""
        return self._on_match_conn(resp.command(b"HMGET", key, *fields),
                                   lambda: self.client.hmget(key, fields))

    def read_records(self, fields: list[bytes]) -> list:
        """``[meta, values]``: the ``READ`` script (a reader's catch-up counters and these
        records, in one atomic read) on the match path's connection, or the reply to the
        one :meth:`read_ahead` sent for these records."""
        script, keys = self._read_script, [self.keys["meta"], self.keys["seg"]]
        through_client = functools.partial(script, keys=keys, args=fields)
        data = self._ahead.command_for(fields)
        try:
            return self._on_match_conn(data, through_client)
        except valkey.exceptions.NoScriptError:  # (a node that restarted, or a new one)
            self._node_client().script_load(script.script)
            return self._on_match_conn(data, through_client)

    def read_ahead(self, keys: list[bytes]) -> None:
        """Send the ``READ`` of these segment keys a reader's match is about to make
        (:meth:`read_records`), not waiting for its reply: a reader of several
        namespaces (:mod:`sarp.shards`) waits for their nodes at once.  A send that
        fails is forgotten (the match asks again).  Cost: one send."""
        ahead = self._ahead
        if ahead.pending is not None:
            return
        data = ahead.command(keys)
        try:
            self._match_connection().send_packed_command([data])
        except (valkey.exceptions.ValkeyError, OSError):
            self.drop_match_connection()
            return
        ahead.pending, ahead.fields = data, keys

    def _match_connection(self):
        if self._match_conn is None:
            self._match_conn = self._node_client().connection_pool.make_connection()
        return self._match_conn

    def match_socket(self) -> tuple[int, float] | None:
        """The match connection's socket for :func:`sarp.valkey_read.match_each`'s C:
        (descriptor, timeout in seconds), connected; None: TLS, or no connection, or a
        reply not read yet (the Python path reads it)."""
        try:
            conn = self._match_connection()
            conn.connect()  # (nothing when connected)
        except (valkey.exceptions.ValkeyError, OSError):
            self.drop_match_connection()
            return None
        if self._ahead.pending is not None or self.settings["ssl"] or conn._sock is None:
            return None
        return conn._sock.fileno(), conn.socket_timeout or 10.0

    def adopt_reply(self, keys: list[bytes], reply: list) -> None:
        """The reply to the ``READ`` of ``keys`` that C read on the match connection:
        the read of these keys takes it (:meth:`read_records`) as if sent ahead."""
        ahead = self._ahead
        ahead.pending, ahead.fields, ahead.reply = ahead.command(keys), keys, reply

    def drop_match_connection(self) -> None:
        """Let the match connection go (a reply may be left on it); the next read
        connects again."""
        if self._match_conn is not None:
            with contextlib.suppress(valkey.exceptions.ValkeyError, OSError):
                self._match_conn.disconnect()
        self._match_conn, self._ahead.pending, self._ahead.reply = None, None, None

    def read_failed(self, exc: BaseException) -> StoreError | None:
        """What a read transaction raises for the client's error ``exc``, or None."""
        if isinstance(exc, UNREACHABLE):
            return StoreError(f"{self.path}: reading failed ({exc}); is Valkey up?")
        if isinstance(exc, valkey.exceptions.ValkeyError):
            return _refused(self.path, "reading", exc)
        return None

    def _on_match_conn(self, data: bytes, through_client: Callable[[], T]) -> T:
        """One packed command on a connection to the namespace's node kept for the match
        path (the Index's lock makes its matches one at a time): the client's per-call
        layers, a cluster client's most of all, cost about as much as a loopback round
        trip.  A command :meth:`read_ahead` sent is not sent again, or is read past.
        When the slot has moved (a cluster being resharded) or the node cannot be
        reached (a failover), the connection is let go and ``through_client()`` asks
        through the client, which follows the slot and the topology."""
        ahead, self._ahead.pending = self._ahead.pending, None
        reply, self._ahead.reply = self._ahead.reply, None
        if reply is not None:  # read by C (adopt_reply): nothing of it left on the wire
            if ahead == data:
                return reply
            ahead = None
        conn = self._match_connection()
        try:
            if ahead is not None and ahead != data:
                with contextlib.suppress(valkey.exceptions.ResponseError):
                    conn.read_response()  # another read's reply: not this one's
            if ahead != data:
                conn.send_packed_command([data])
            return conn.read_response()
        except valkey.exceptions.ResponseError as exc:
            if not isinstance(exc, _MOVED) and not str(exc).startswith(_MOVED_WORDS):
                raise
        except UNREACHABLE:
            pass
        except BaseException:
            self.drop_match_connection()  # a reply may be left unread: the next call connects
            raise
        self.drop_match_connection()
        return through_client()

    def trim_log(self, upto: int) -> None:
        """Drop log entries with sequence <= ``upto`` (a snapshot covers them)."""

        def trim(w: ValkeyWriteTxn) -> None:
            w.set_counter("log_trimmed_upto", max(upto, w.counter("log_trimmed_upto")))
            w.trim_below = upto + 1

        self.write(trim)

    def load_snapshot(self) -> snapshots.Snapshot:
        data = self.client.get(self.keys["snap"])
        if data is None:
            raise snapshots.SnapshotUnusable(f"{self.path}: no snapshot yet")
        return snapshots.decode(data, f"{self.path} snapshot")

    def save_snapshot(self, watermark: int, directory, holders) -> int:
        self._check_lease()
        data = b"".join(snapshots.encode(self.index_id, watermark, directory, holders))
        self._run(self._set, [self.keys["lease"], self.keys["snap"]], [self._lease_value, data])
        return len(data)

    def load_state(self, name: str) -> bytes | None:
        """A small state value kept with the index (the subscriber's resume point), so
        that a writer taking over on another machine resumes from it."""
        return self.client.get(self.state_key(name))

    def save_state(self, name: str, data: bytes, durable: bool) -> None:
        self._check_lease()
        self._run(self._set, [self.keys["lease"], self.state_key(name)],
                  [self._lease_value, data])

    def state_key(self, name: str) -> bytes:
        return self.keys["meta"][: -len(b"meta")] + b"state:" + name.encode()

    def _run(self, script, keys: list, args: list):
        return self._guarded(lambda: script(keys=keys, args=args))

    def transact(self, commands: list[bytes]) -> None:
        """``commands`` (packed by :mod:`sarp.resp`) applied all together, and only while
        this writer holds the lease: ``WATCH`` of the lease and its ``GET`` (one round
        trip; not ours: :class:`sarp.LeaseLostError`), then ``MULTI``, the commands and
        ``EXEC`` (one round trip), which the server refuses when the lease key changed
        after the ``WATCH`` (taken over, expired, or renewed by this writer's own
        thread: then it is asked again).  Errors as :meth:`_run` gives them.

        Cost: two round trips; the server parses each argument once (a script's would
        each become a Lua string and back)."""
        def call() -> None:
            for _ in range(TRANSACT_TRIES):
                if self._exec_fenced(commands):
                    return
            raise StoreError(f"{self.path}: a write was refused {TRANSACT_TRIES} times "
                             "because the lease key kept changing; the index is unchanged")
        self._guarded(call)

    def _exec_fenced(self, commands: list[bytes]) -> bool:
        """One try of :meth:`transact`: False when ``EXEC`` was refused (nothing done)."""
        pool = self._node_client().connection_pool
        conn = pool.get_connection("MULTI")
        try:
            conn.send_packed_command([resp.command(b"WATCH", self.keys["lease"]),
                                      resp.command(b"GET", self.keys["lease"])])
            conn.read_response()
            if conn.read_response() != self._lease_value:
                conn.send_packed_command([resp.command(b"UNWATCH")])
                conn.read_response()
                raise valkey.exceptions.ResponseError("SARPFENCED the lease is not ours")
            conn.send_packed_command([resp.command(b"MULTI"), *commands,
                                      resp.command(b"EXEC")])
            refused = []  # a command refused as it is queued (OOM): EXEC does nothing
            for _ in range(len(commands) + 1):
                try:
                    conn.read_response()
                except valkey.exceptions.ResponseError as exc:
                    refused.append(exc)
            try:
                done = conn.read_response()
            except valkey.exceptions.ResponseError as exc:
                # nothing done: EXECABORT (the first refusal says why), or OOM at EXEC
                raise (refused[0] if refused else exc) from None
            if done is None:
                self.exec_refused += 1
                return False
            failed = [r for r in done if isinstance(r, Exception)]
            if failed:  # (WRONGTYPE: another program's key) the others were applied
                self.maybe_applied = True
                raise failed[0]
            return True
        except BaseException:
            conn.disconnect()  # a reply may be left unread: the next use connects again
            raise
        finally:
            pool.release(conn)

    def _node_client(self):
        """A client of the node holding the namespace (the one client, off a cluster)."""
        client = self.client
        if hasattr(client, "get_node_from_key"):  # a cluster: every key is in one slot
            client = client.get_valkey_connection(client.get_node_from_key(self.keys["meta"]))
        return client

    def execute_packed(self, data: bytes):
        """One command packed by :mod:`sarp.resp`, on the namespace's node: its reply
        (a server error raised).  Cost: one round trip."""
        pool = self._node_client().connection_pool
        conn = pool.get_connection("EVALSHA")
        try:
            conn.send_packed_command([data])
            return conn.read_response()
        except BaseException:
            conn.disconnect()  # a reply may be left unread: the next use connects again
            raise
        finally:
            pool.release(conn)

    def _guarded(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except valkey.exceptions.ResponseError as exc:
            if "SARPFENCED" in str(exc):
                self._lost.set()
                raise LeaseLostError(f"{self.path}: this writer lost its lease (another "
                                     "writer took over, or it was paused past the lease); "
                                     "the write was refused; reopen") from None
            if isinstance(exc, valkey.exceptions.OutOfMemoryError) or "OOM" in str(exc):
                raise StoreFullError(f"{self.path}: Valkey is out of memory ({exc}); the "
                                     "index is unchanged") from exc
            raise StoreError(f"{self.path}: write failed: {exc}") from exc
        except UNREACHABLE as exc:
            self.maybe_applied = True
            self._check_lease()  # a write that outlived the lease is a lost lease
            raise StoreError(f"{self.path}: write failed ({exc}); it may or may not have "
                             "been applied: the writer reads the stored state again before "
                             "its next write") from exc


def _refused(where, doing: str, exc: Exception) -> StoreError:
    """A command Valkey answered with an error: a key of the namespace holds another
    type (``WRONGTYPE``), a command the server refuses, ..."""
    return StoreError(f"{where}: Valkey refused a command while {doing} ({exc}); if a key "
                      "of the namespace holds something else, another program uses the "
                      "namespace: give sarp a namespace of its own")


def _aof_enabled(client) -> bool:
    try:
        return bool(int(client.info("persistence").get("aof_enabled", 0)))
    except valkey.exceptions.ValkeyError:
        return False
