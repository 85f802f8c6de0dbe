"""A reader's reads on Valkey: the read transaction (:class:`ValkeyReadTxn`), and
readers matching one chain in C (:func:`match_each`: ``sarp._native``'s
``read_match``, ``valkey_read.c``).

:func:`match_each` does, for each namespace (the one index, or every shard of
:mod:`sarp.shards`), the directory's prediction and the ``READ`` packed and sent on
the namespace's match connection; once every read is sent, each reply is parsed, its
counters checked against the reader's memory and the walk done over its records.  The
Python path (:func:`sarp.recovery.current_read` and :func:`sarp.verify.match_one`) is
the reference, and takes up what C hands back: a reply whose counters moved (the
catch-up reads the log), an error reply, a walk C does not do (meta asked, more
holders than it takes), a damaged record, a broken connection.  Like the rest of the
Valkey backend, it calls the client its store hands it (:mod:`sarp.store_valkey`
imports it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import native, recovery
from .answer import Match, plain_answer
from .errors import DamagedIndexError
from .segment import Segment, decode
from .store import (
    BLOCK_VALUE,
    LOG_VALUE,
    U64,
    Capabilities,
    alias_columns,
    counter_value,
    holder_names,
    log_arrays,
)
from .verify import PrefixWalk

if TYPE_CHECKING:
    from .store_valkey import ValkeyStore

# every read is a round trip: a match fetches its predicted records in one
CAPABILITIES = Capabilities(local_reads=False, prefetch=True)
_UNREAD = object()


class ValkeyReadTxn:
    """Reads for a match or a reader's catch-up.  Each command sees every write that had
    returned before it; the verifier checks every record on its own."""

    __slots__ = ("_store", "_c", "_meta", "_fetched", "reads")
    capabilities = CAPABILITIES

    def __init__(self, store: ValkeyStore) -> None:
        self._store = store
        self._c = store.client
        self._meta: dict[bytes, bytes] | None = None
        self._fetched: dict[bytes, bytes | None] = {}  # by segment key (u64 BE)
        self.reads = 0

    @property
    def native_get(self) -> Callable[[bytes], bytes | None]:
        """A record by its key, for the walk in C: the prefetched one, or an ``HGET``."""
        return self._get

    def _get(self, key: bytes) -> bytes | None:
        value = self._fetched.get(key, _UNREAD)
        return self._c.hget(self._store.keys["seg"], key) if value is _UNREAD else value

    def prefetch(self, keys: list[bytes], with_counters: bool = False) -> None:
        """Fetch the records of these segment keys in one ``HMGET`` (one round trip, one
        atomic read), so the match's steps read them from memory; ``with_counters``: the
        ``meta`` counters too, in the same transaction (a reader's catch-up then costs
        no round trip when nothing changed)."""
        fetched = self._fetched
        wanted = [k for k in keys if k not in fetched] if fetched else keys
        if with_counters and self._meta is None:
            # a script: one atomic read in one round trip
            meta, values = self._store.read_records(wanted)
            self._meta = dict(zip(meta[::2], meta[1::2], strict=True))
            fetched.update(zip(wanted, values, strict=True))
        elif wanted:
            fetched.update(zip(wanted, self._store.hmget(self._store.keys["seg"], wanted),
                               strict=True))

    def forget_prefetched(self) -> None:
        self._fetched.clear()

    def __enter__(self) -> ValkeyReadTxn:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and (failed := self._store.read_failed(exc)) is not None:
            raise failed from exc

    def record(self, seg_id: int) -> bytes | None:
        self.reads += 1
        return self._get(U64.pack(seg_id))

    def segment(self, seg_id: int) -> Segment | None:
        record = self._c.hget(self._store.keys["seg"], U64.pack(seg_id))
        return None if record is None else decode(seg_id, record)

    def raw_records(self, seg_ids: list[int]) -> list[bytes | None]:
        """The unchecked records of many segments, in order: one ``HMGET``."""
        if not seg_ids:
            return []
        return self._c.hmget(self._store.keys["seg"], [U64.pack(s) for s in seg_ids])

    def counter(self, name: str) -> int:
        raw = self._meta_fields().get(name.encode())
        return counter_value(raw, name, self._store.path)

    def index_id(self) -> bytes | None:
        """The id the index was created with, as of this transaction (a server that
        restarted empty and was written again has another one)."""
        return self._meta_fields().get(b"index_id")

    def _meta_fields(self) -> dict[bytes, bytes]:
        if self._meta is None:  # one round trip per transaction, on first use
            self._meta = self._c.hgetall(self._store.keys["meta"])
        return self._meta

    def log_since(self, seq: int) -> Iterator[tuple[int, int, int]]:
        start = f"{seq + 1}-0"
        while True:
            entries = self._c.xrange(self._store.keys["log"], min=start, count=10_000)
            for entry_id, fields in entries:
                s = int(entry_id.split(b"-")[0])
                seg_id, first_hash = LOG_VALUE.unpack(fields[b"v"])
                yield s, seg_id, first_hash
            if len(entries) < 10_000:
                return
            start = f"({entries[-1][0].decode()}"

    def log_arrays(self, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return log_arrays([(U64.pack(s), LOG_VALUE.pack(g, f))
                           for s, g, f in self.log_since(seq)])

    def raw_segments(self) -> Iterator[tuple[int, bytes]]:
        for key, record in self._c.hscan_iter(self._store.keys["seg"], count=1000):
            yield U64.unpack(key)[0], record

    def blocks(self) -> Iterator[tuple[int, int, int]]:
        for key, value in self._c.hscan_iter(self._store.keys["blk"], count=1000):
            seg_id, offset = BLOCK_VALUE.unpack(value)
            yield U64.unpack(key)[0], seg_id, offset

    def aliases_problems(self) -> list[str]:
        """The aliases hash read as a write reads it: a line for a damaged entry."""
        try:
            alias_columns(self._c.hscan_iter(self._store.keys["alias"], count=1000),
                          self._store.path, "")
        except DamagedIndexError as exc:
            return [str(exc)]
        return []

    def holder_names(self) -> dict[int, str | None]:
        table = self._c.hgetall(self._store.keys["hold"])
        required = b"name_sums" in self._meta_fields()
        return holder_names(((k, v) for k, v in table.items() if k.startswith(b"i:")),
                            lambda packed: table.get(b"s:" + packed), required)

    def stat(self, table: str) -> dict:
        key = {"segments": "seg", "blocks": "blk", "holders": "hold", "meta": "meta",
               "aliases": "alias"}.get(table)
        if key is None:
            return {"entries": self._c.xlen(self._store.keys["log"])}
        return {"entries": self._c.hlen(self._store.keys[key])}


@dataclass(slots=True)
class Reading:
    """What an :class:`sarp.Index` reads with (``Index.reading``): its lock, store,
    memory, counters and match observers, and its own ``match`` (the Python path)."""

    lock: threading.RLock
    store: object
    memory: recovery.Memory
    counters: object
    observers: list[Callable[[np.ndarray], None]]
    match: Callable[..., Match]
    readonly: bool


def match_each(readings: Sequence[Reading], query: np.ndarray, with_meta: bool = False,
               with_presence: bool = False) -> list[Match]:
    """Each index's :meth:`sarp.Index.match` of ``query``, their reads at once.

    Readers of Valkey (plain TCP, the C extension loaded, no meta asked) go through
    one ``read_match`` call; the others send their reads ahead
    (:func:`sarp.recovery.read_ahead`) and match as usual.  Every answer is exactly
    what ``match`` gives: C's walk is the Python walk's mirror, and whatever it hands
    back is matched by ``match`` on the reply C read.
    """
    locks = sorted({id(r.lock): r.lock for r in readings}.values(), key=id)  # one order
    for lock in locks:
        lock.acquire()
    try:
        answers: list[Match | None] = [None] * len(readings)
        parts = [None if with_meta else _part(r) for r in readings]
        fast = [i for i, part in enumerate(parts) if part is not None]
        for i, r in enumerate(readings):
            if parts[i] is None and r.readonly and r.store.capabilities.prefetch:
                recovery.read_ahead(r.store, r.memory, query)
        if fast:
            rows = with_presence or any(readings[i].memory.holders.multi_medium for i in fast)
            for i, answer in zip(fast, _read_match(readings, parts, fast, query, rows,
                                                   with_presence), strict=True):
                answers[i] = answer
        return [answers[i] if answers[i] is not None else r.match(query, with_meta, with_presence)
                for i, r in enumerate(readings)]
    finally:
        for lock in reversed(locks):
            lock.release()


def _part(r: Reading) -> tuple | None:
    """``r``'s shard for ``read_match`` and its timeout, or None: the Python path."""
    store, memory = r.store, r.memory
    if native.C is None or not r.readonly or memory.ahead is not None or \
            not hasattr(store, "match_socket") or store.index_id is None:
        return None
    arrays = memory.directory.native_arrays()
    link = store.match_socket() if arrays is not None else None
    if link is None:
        return None
    fd, timeout_s = link
    return (fd, store.read_head, store.index_id, memory.watermark, *arrays), timeout_s


def _read_match(readings, parts, fast: list[int], query: np.ndarray, rows: bool,
                with_presence: bool) -> list[Match | None]:
    """The answers of the readings at ``fast``; None where the Python path answers.
    ``rows``: C gives each holder's presence (asked, or some instance in two media)."""
    timeout_ms = int(1000 * max(parts[i][1] for i in fast))
    out: list[Match | None] = []
    try:  # every READ sent; each reply read (and named here) while the next are coming
        for i, answer in zip(fast, native.C.read_match(
                query, [parts[i][0] for i in fast], timeout_ms, rows), strict=True):
            out.append(_taken(readings[i], query, answer, rows, with_presence))
    except BaseException as exc:  # a reply may be left unread: let the connections go
        for i in fast:
            readings[i].store.drop_match_connection()
        if isinstance(exc, OSError | ValueError):  # (TimeoutError is an OSError)
            return out + [None] * (len(fast) - len(out))
        raise
    return out


def _taken(r: Reading, query: np.ndarray, answer: tuple, rows: bool,
           with_presence: bool) -> Match | None:
    """One reader's answer from C, or None: the Python path answers it."""
    if answer[0] == "reply":  # the counters moved: the catch-up takes this reply
        keys = r.memory.directory.predicted_keys(query)
        r.store.adopt_reply(keys, [answer[1], answer[2]])
        r.memory.ahead = (query, keys)
        return None
    if answer[0] == "error" or answer[3] != -1:  # refused, or a damaged record
        return None
    return _named(r, query, *answer[:3], rows, with_presence)


def _named(r: Reading, query: np.ndarray, total: int, reads: int, runs: dict, rows: bool,
           with_presence: bool) -> Match:
    """C's walk as ``match`` answers it, counted: each holder's run (one medium per
    instance), or each holder's presence rows (:meth:`sarp.verify.PrefixWalk.take_rows`)."""
    holders = r.memory.holders
    if rows:
        walk = PrefixWalk(holders.instance_of if holders.multi_medium else None, False,
                          with_presence)
        walk.take_rows(total, runs)
        m = walk.result(holders.names, holders.instance_names, reads)
    else:
        m = plain_answer(total, runs, holders.names, reads)
    for observe in r.observers:
        observe(query)
    r.counters.matched([m])
    return m
