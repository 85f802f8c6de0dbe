"""A write on Valkey (:mod:`sarp.store_valkey`'s): its reads, answered from what it has
read and fetched ahead for the batch, and its changes, buffered and committed at the
end by one ``MULTI``/``EXEC`` the lease fences (:meth:`ValkeyStore.transact`).  It
calls the client its store hands it and imports no client itself.
"""

from __future__ import annotations

from itertools import compress
from operator import not_
from typing import TYPE_CHECKING

import numpy as np

from . import native, resp
from .errors import CorruptRecordError
from .segment import Segment, writable
from .store import (
    BLOCK_DTYPE,
    BLOCK_VALUE,
    ID_STRIDE,
    U64,
    WriteLogic,
    alias_columns,
    alias_keys,
    counter_value,
    hash_keys,
)
from .valkey_read import CAPABILITIES
from .valkey_scripts import LOG

if TYPE_CHECKING:
    from .store_valkey import ValkeyStore

LOG_DTYPE = np.dtype([("seg", "<u4"), ("hash", "<u8")])  # LOG_VALUE's bytes, as an array
TABLES = ("meta", "seg", "blk", "hold", "alias")  # hashes a write changes, in commit order
BUFFERED = tuple(t for t in TABLES if t != "blk")  # in dicts; `blocks` is a BlockTable
COMMAND_ARGS = 100_000  # fields (or field/value items) per HSET or HDEL of a commit
KNOWN_BLOCKS = 1_000_000  # blocks entries a writer keeps between writes (at most 36 MB in C)


class BlockView:
    """What a write on Valkey knows of the ``blocks`` table, hash -> entry (6 bytes:
    segment id, offset), as the server had it and as the write changed it; an entry it
    knows nothing of is ``fetch(key)`` (a round trip), remembered.  The Python
    reference of ``sarp._native.BlockTable``, which ``pack_batch`` reads and changes in
    C and whose changes the commit takes as arrays (:func:`block_table` picks one).

    Cost: a dict entry per block named (the C table: 16 bytes, no Python object).

    >>> view = BlockView(lambda key: None)  # (a server with no entries)
    >>> view.load(np.array([7], np.uint64), [None])  # 7 read: the server has none
    >>> view.put(np.array([7, 8], np.uint64), 3, 0)
    >>> [np.frombuffer(b, t).tolist() for b, t in zip(view.get(np.array([8, 9], np.uint64)),
    ...                                               ("<u4", "<u2"))]
    [[3, 0], [1, 0]]
    >>> view.delete(np.array([7, 8], np.uint64))  # 8 was never read: its delete is sent
    >>> np.frombuffer(view.changes()[2], ">u8").tolist()
    [8]
    """

    def __init__(self, fetch) -> None:
        native.ran_python("block_table")
        self.fetch = fetch
        self._had: dict[int, bytes | None] = {}  # as the server has it (None: absent)
        self._now: dict[int, bytes | None] = {}  # as this write changed it
        self._asked: set[int] = set()  # named by wanted()

    def _entry(self, h: int) -> bytes | None:
        if h in self._now:
            return self._now[h]
        if h not in self._had:
            self._had[h] = self.fetch(U64.pack(h))
        return self._had[h]

    def wanted(self, hashes: np.ndarray) -> bytes:
        """The distinct hashes the write knows nothing of, first seen first; each is
        named once (until :meth:`load` records it, a lookup still fetches it)."""
        new = [h for h in dict.fromkeys(np.asarray(hashes).tolist())
               if h not in self._had and h not in self._now and h not in self._asked]
        self._asked.update(new)
        return np.array(new, np.uint64).tobytes()

    def load(self, hashes: np.ndarray, values: list[bytes | None]) -> None:
        """The server's entries of ``hashes`` (a known one keeps what the write has)."""
        for h, value in zip(np.asarray(hashes).tolist(), values, strict=True):
            if h not in self._had and h not in self._now:
                self._had[h] = value

    def get(self, hashes: np.ndarray) -> tuple[bytes, bytes]:
        """Segment ids (uint32) and offsets (uint16) of ``hashes``, 0 where absent."""
        absent = b"\0" * BLOCK_VALUE.size
        found = np.frombuffer(b"".join(self._entry(h) or absent
                                       for h in np.asarray(hashes).tolist()), BLOCK_DTYPE)
        return found["seg"].tobytes(), found["off"].tobytes()

    def put(self, hashes: np.ndarray, seg_id: int, first_offset: int) -> None:
        for i, h in enumerate(np.asarray(hashes).tolist()):
            self._now[h] = BLOCK_VALUE.pack(seg_id, first_offset + i)

    def delete(self, hashes: np.ndarray) -> None:
        self._now.update(dict.fromkeys(np.asarray(hashes).tolist()))

    def take(self, known: BlockView, hashes: np.ndarray) -> bytes:
        """Copy in ``known``'s entries of ``hashes`` (the writer's table of what the
        server has, kept between its writes) as read; return the hashes it lacks."""
        lacking = []
        for h in np.frombuffer(np.ascontiguousarray(hashes, np.uint64), np.uint64).tolist():
            if h in known._had:
                if h not in self._now and h not in self._had:
                    self._had[h] = known._had[h]
            else:
                lacking.append(h)
        return np.array(lacking, np.uint64).tobytes()

    def absorb(self, write: BlockView) -> None:
        """What a committed write knows, as the server now has it."""
        self._had.update(write._had)
        self._had.update(write._now)

    def __len__(self) -> int:
        return len(self._had) + len(self._now)

    def changes(self) -> tuple[bytes, bytes, bytes]:
        """The commit's: keys set (8 bytes each, big-endian), their values, and keys
        deleted that the server has (as ``hash_keys`` gives them), end to end."""
        sets = [(h, v) for h, v in self._now.items() if v is not None]
        gone = [h for h, v in self._now.items()
                if v is None and not (h in self._had and self._had[h] is None)]
        return (b"".join(hash_keys(np.array([h for h, _ in sets], np.uint64))),
                b"".join(v for _, v in sets), b"".join(hash_keys(np.array(gone, np.uint64))))


def _block_commands(name: bytes, keys: bytes, values: bytes, gone: bytes) -> list[bytes]:
    """The ``HSET`` and ``HDEL`` commands of :meth:`BlockView.changes`' arrays."""
    keys_v, values_v = np.frombuffer(keys, "V8"), np.frombuffer(values, "V6")
    gone_v, step = np.frombuffer(gone, "V8"), COMMAND_ARGS // 2
    return [*(resp.command(b"HSET", name, resp.Fixed(keys_v[at:at + step],
                                                      values_v[at:at + step]))
              for at in range(0, len(keys_v), step)),
            *(resp.command(b"HDEL", name, resp.Fixed(gone_v[at:at + COMMAND_ARGS]))
              for at in range(0, len(gone_v), COMMAND_ARGS))]


def block_table(fetch=None):
    """A write's ``blocks`` table: ``sarp._native.BlockTable`` when the C code is on,
    else :class:`BlockView`; without ``fetch``, one that never fetches (the writer's
    table of what the server has, :meth:`ValkeyWriteTxn.remember`)."""
    c = native.C
    fetch = fetch or _never_fetch
    return c.BlockTable(fetch) if c is not None else BlockView(fetch)


def _never_fetch(key: bytes) -> None:
    raise RuntimeError("the writer's table of known blocks never fetches")


def _packed(*columns: list[bytes]) -> list:
    """Equal-length columns (keys; or keys and values) as one command's arguments,
    interleaved: one :class:`sarp.resp.Fixed` run when each column has one width."""
    if len(columns[0]) > 64:
        packed = resp.Fixed.of(*columns, width=tuple(len(c[0]) for c in columns))
        if packed is not None:
            return [packed]
    return [item for row in zip(*columns, strict=True) for item in row]


class _Known(dict):
    """A write's view of one table: what it changed, over what it has read (None:
    absent); a key it holds neither of is ``fetch(key)`` (a round trip), remembered.
    Its ``__getitem__`` is a C call for every key the write knows, which is how
    ``pack_batch`` reads it."""

    __slots__ = ("fetch",)

    def __init__(self, fetch) -> None:
        super().__init__()
        self.fetch = fetch

    def __missing__(self, key: bytes) -> bytes | None:
        value = self[key] = self.fetch(key)
        return value


class ValkeyWriteTxn(WriteLogic):
    """A write's reads (through its own pending changes) and its changes, committed at
    the end by one transaction the lease fences (:meth:`commit`)."""

    capabilities = CAPABILITIES

    def __init__(self, store: ValkeyStore) -> None:
        self._store = store
        self._c = store.client
        self._pending: dict[str, dict[bytes, bytes | None]] = {t: {} for t in BUFFERED}
        # what this write has changed over what it has read, per table; the writer
        # holds the lease, so nothing else changes the tables meanwhile
        self._view = {t: _Known(self._fetcher(t)) for t in BUFFERED}
        # keys read as absent: a delete of one of them is left out of the commit
        self._absent: dict[str, set[bytes]] = {t: set() for t in BUFFERED}
        self._meta: dict[bytes, bytes] | None = None
        self._holders_read = False
        self._log: list[bytes] = []  # the log entries' values, end to end
        self._log_first = 0  # the sequence of the first (they are consecutive)
        self._log_next = 0
        self.trim_below: int | None = None
        self._states: dict[str, bytes] = {}  # put_state's, SET in the commit
        c, name = self._c, store.keys["blk"]  # (the table must not hold the write: a cycle)
        self._blocks = block_table(lambda key: c.hget(name, key))

    # reads through the pending changes

    def _fetcher(self, table: str):
        name = self._store.keys[table]

        def fetch(key: bytes) -> bytes | None:
            if table == "hold":  # small, and a batch asks for several: all of it at once
                if not self._holders_read:
                    self._read_holders()
                    return self._view["hold"].get(key)
                return None  # the whole table was read: absent
            if table == "seg" and U64.unpack(key)[0] > self._seg_ceiling():
                return None  # never given out: no record can have it
            value = self._c.hget(name, key)
            if value is None:
                self._absent[table].add(key)
            return value
        return fetch

    def _get(self, table: str, key: bytes) -> bytes | None:
        return self._view[table][key]

    def _seg_ceiling(self) -> int:
        """The highest segment id given out before this write (``next_seg_id`` as
        stored): the tails split off this write's new segments look above it."""
        return counter_value(self._stored_meta().get(b"next_seg_id"), "next_seg_id",
                             self._store.path)

    def _stored_meta(self) -> dict[bytes, bytes]:
        """The meta hash as stored before this write (one ``HGETALL``, at first use)."""
        if self._meta is None:
            self._meta = self._c.hgetall(self._store.keys["meta"])
        return self._meta

    def _get_many(self, table: str, keys: list[bytes]) -> list[bytes | None]:
        """Each key's value, this write's changes first, then what it has read; the
        rest in one ``HMGET`` (remembered)."""
        view = self._view[table]
        missing = [k for k in dict.fromkeys(keys) if k not in view]
        if missing:
            values = self._hmget(table, missing)
            view.update(zip(missing, values, strict=True))
            self._absent[table].update(compress(missing, map(not_, values)))
        return [view[k] for k in keys]

    def _hmget(self, table: str, keys: list[bytes] | np.ndarray) -> list[bytes | None]:
        """``HMGET`` of ``keys`` (bytes, or block hashes as a ``uint64`` array): many of
        one width packed by :mod:`sarp.resp`."""
        name = self._store.keys[table]
        if isinstance(keys, np.ndarray):
            packed = resp.Fixed(keys.astype(">u8").view("V8")) if keys.size > 64 else None
            keys = hash_keys(keys) if packed is None else keys
        else:
            packed = resp.Fixed.of(keys, width=(len(keys[0]),)) if len(keys) > 64 else None
        if packed is None:
            return self._c.hmget(name, keys)
        return self._store.execute_packed(resp.command(b"HMGET", name, packed))

    def _read_holders(self) -> None:
        view = self._view["hold"]
        for key, value in self._c.hgetall(self._store.keys["hold"]).items():
            view.setdefault(key, value)  # this write's changes stay
        self._holders_read = True

    def prefetch_blocks(self, hashes: np.ndarray) -> None:
        """The ``blocks`` entries of ``hashes`` and the records they name, in two round
        trips (the entries the writer kept from its last writes cost none), so that the
        batch's lookups are answered from memory."""
        new = self._fetch_blocks(hashes)
        if new.size:
            seg_ids = np.frombuffer(self._blocks.get(new)[0], np.uint32)
            if seg_ids.any():
                self.prefetch_segments(seg_ids[seg_ids != 0])

    def _fetch_blocks(self, hashes: np.ndarray) -> np.ndarray:
        """Into the table, the entries of the distinct ``hashes`` the write knew nothing
        of: those the writer kept from its last commits (:meth:`remember`), the rest in
        one ``HMGET`` (its keys packed from the array); returns those hashes."""
        new = np.frombuffer(self._blocks.wanted(np.ascontiguousarray(hashes, np.uint64)),
                            np.uint64)
        wanted = new
        known = self._store.known_blocks
        if new.size and known is not None and type(known) is type(self._blocks):
            if self._stored_meta().get(b"next_seq") == self._store.known_seq:
                wanted = np.frombuffer(self._blocks.take(known, new), np.uint64)
            else:  # the server is not as this writer's last commit left it (it restarted)
                self._store.known_blocks = None
        if wanted.size:
            self._blocks.load(wanted, self._hmget("blk", wanted))
        return new

    def prefetch_segments(self, seg_ids: np.ndarray) -> None:
        """The records of ``seg_ids`` and of the ids kept after each for the tails
        split off it (up to the highest id given out), in one round trip."""
        seg_ids = np.unique(seg_ids).astype(np.uint64)
        homes = seg_ids[seg_ids % ID_STRIDE == 0]
        tails = (homes[:, None] + np.arange(1, ID_STRIDE, dtype=np.uint64)).ravel()
        wanted = np.union1d(seg_ids, tails[tails <= self._seg_ceiling()])
        self._get_many("seg", [U64.pack(int(i)) for i in wanted])

    def _put(self, table: str, key: bytes, value: bytes | None) -> None:
        self._pending[table][key] = value
        self._view[table][key] = value

    def _put_many(self, table: str, items) -> None:
        self._pending[table].update(items)
        self._view[table].update(items)

    def counter(self, name: str) -> int:
        key = name.encode()
        pending = self._pending["meta"]
        raw = pending[key] if key in pending else self._stored_meta().get(key)
        return counter_value(raw, name, self._store.path)

    def set_counter(self, name: str, value: int) -> None:
        self._put("meta", name.encode(), U64.pack(value))

    def put_meta(self, key: bytes, value: bytes) -> None:
        self._put("meta", key, value)

    def put_state(self, name: str, data: bytes) -> None:
        self._states[name] = data

    def segment(self, seg_id: int) -> Segment:
        record = self._get("seg", U64.pack(seg_id))
        if record is None:
            raise CorruptRecordError(f"blocks table names segment {seg_id}, which is missing")
        return writable(seg_id, record)

    def segment_exists(self, seg_id: int) -> bool:
        return self._get("seg", U64.pack(seg_id)) is not None

    def put_segment(self, seg: Segment) -> None:
        self._put("seg", U64.pack(seg.seg_id), seg.encode())

    def delete_segment(self, seg: Segment) -> None:
        self._put("seg", U64.pack(seg.seg_id), None)
        self.release_blocks(seg.hashes)

    def locate(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Segment id and offset of each hash (segment id 0 where absent): one ``HMGET``
        of those the write does not know."""
        hashes = np.ascontiguousarray(hashes, np.uint64)
        self._fetch_blocks(hashes)
        segs, offsets = self._blocks.get(hashes)
        return np.frombuffer(segs, np.uint32).copy(), np.frombuffer(offsets, np.uint16).copy()

    def native_calls(self) -> tuple:
        """What ``sarp._native.pack_batch`` calls (see ``LmdbWriteTxn.native_calls``),
        here on this write's buffered changes and what it has read (after
        :meth:`prefetch_blocks`, a batch's lookups are answered from memory); the
        tables are named by their hash's name, and a deferred batch's cursor calls are
        not offered (deferred writes are LMDB's page locality, none here)."""
        put = (self._view, self._pending)  # dicts pack_batch puts into itself (None: delete)
        if isinstance(self._blocks, BlockView):
            raise RuntimeError("this write began on the Python path (SARP_PURE_PYTHON or "
                               "native.forced): pack_batch needs its blocks in C")

        def deferred_only(*_args):
            raise RuntimeError("a deferred batch runs on LMDB only")

        return (self._blocks, self._view["seg"].__getitem__, self.segment,
                self.new_segment_id, self.untake_segment_ids,
                lambda name: self.holder_id(name, create=False), self.new_holder_id,
                put, put, "seg", "blk", deferred_only, deferred_only, deferred_only)

    def put_blocks(self, hashes: np.ndarray, seg_id: int, first_offset: int) -> None:
        self._blocks.put(np.ascontiguousarray(hashes, np.uint64), seg_id, first_offset)

    def locate_one(self, block_hash: int) -> tuple[int, int]:
        seg_ids, offsets = self.locate(np.array([block_hash], np.uint64))
        return int(seg_ids[0]), int(offsets[0])

    def claim_blocks(self, hashes: np.ndarray, seg_id: int, first_offset: int) -> bool:
        """:meth:`put_blocks` if none of ``hashes`` is stored (one ``HMGET``); else False."""
        if self.locate(hashes)[0].any():
            return False
        self.put_blocks(hashes, seg_id, first_offset)
        return True

    def release_blocks(self, hashes: np.ndarray) -> None:
        """Delete the ``blocks`` entries of ``hashes`` at commit (no Python per block)."""
        self._blocks.delete(np.ascontiguousarray(hashes, np.uint64))

    def log(self, entries: list[tuple[int, int]]) -> None:
        first = self.take_seqs(len(entries))
        if not self._log:
            self._log_first = first
        elif first != self._log_next:  # take_seqs counts on: never
            raise RuntimeError(f"log sequence {first} after {self._log_next - 1}")
        self._log_next = first + len(entries)
        self._log.append(np.array(entries, LOG_DTYPE).tobytes())

    def holder_get(self, key: bytes) -> bytes | None:
        return self._get("hold", key)

    def holder_put(self, key: bytes, value: bytes | None) -> None:
        """Set (or with None delete) one entry of the holders table, at commit."""
        self._put("hold", key, value)

    def holder_items(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The holders table's entries whose keys start with ``prefix`` (this write's
        changes included), in key order.  Cost: one ``HGETALL``."""
        if not self._holders_read:
            self._read_holders()
        return sorted((k, v) for k, v in self._view["hold"].items()
                      if v is not None and k.startswith(prefix))

    def alias_get(self, root: int, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, found)`` of engine hashes under ``root``, aligned with them (this
        write's changes included): one ``HMGET``."""
        got = self._get_many("alias", alias_keys(root, hashes))
        found = np.array([v is not None for v in got], bool)
        keys = np.zeros(len(got), np.uint64)
        keys[found] = np.frombuffer(b"".join(v for v in got if v is not None), ">u8")
        return keys, found

    def alias_put(self, roots: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        self._put_many("alias", dict(zip(alias_keys(roots, hashes),
                                          keys.astype(">u8").view("V8").tolist(), strict=True)))

    def alias_delete(self, roots: np.ndarray, hashes: np.ndarray) -> None:
        self._put_many("alias", dict.fromkeys(alias_keys(roots, hashes)))

    def alias_scan(self, cursor: int | None, count: int):
        """One ``HSCAN`` step (about ``count`` entries), as columns."""
        after, items = self._c.hscan(self._store.keys["alias"], cursor or 0, count=count)
        return (*alias_columns(items.items(), self._store.path, ""), after or None)

    # the commit

    def _deletes(self, table: str, items: dict[bytes, bytes | None]) -> list[bytes]:
        """The keys ``items`` deletes that the server may have: not those this write
        read as absent (it holds the lease: they still are), nor records above the
        highest segment id given out before it (put and deleted again in it)."""
        absent = self._absent[table]
        dels = [k for k, v in items.items() if v is None and k not in absent]
        if table == "seg" and dels:
            ceiling = U64.pack(self._seg_ceiling())  # big-endian: byte order is numeric
            dels = [k for k in dels if k <= ceiling]
        return dels

    def remember(self) -> None:
        """After the commit: what this write knows of ``blocks`` is what the server has,
        and the store keeps it for the writer's next writes (it holds the lease, so
        nobody else writes), as long as the server's ``next_seq`` is still what this
        commit left (else the server lost writes: a restart), up to
        :data:`KNOWN_BLOCKS` entries (then it starts again)."""
        store = self._store
        seq = self._pending["meta"].get(b"next_seq") or (self._meta or {}).get(b"next_seq")
        if seq is None:
            store.known_blocks = None
            return
        if store.known_blocks is None or len(store.known_blocks) > KNOWN_BLOCKS \
                or type(store.known_blocks) is not type(self._blocks):
            store.known_blocks = block_table()
        store.known_blocks.absorb(self._blocks)
        store.known_seq = seq

    def commit(self) -> None:
        """Every change in one ``MULTI``/``EXEC`` fenced by the lease
        (:meth:`ValkeyStore.transact`): per table an ``HSET`` and an ``HDEL`` (in runs
        of :data:`COMMAND_ARGS`), the log entries through :data:`LOG`, and a ``SET`` per
        :meth:`put_state`."""
        store = self._store
        commands: list[bytes] = []
        for table in TABLES:
            name = store.keys[table]
            if table == "blk":
                commands += _block_commands(name, *self._blocks.changes())
                continue
            items = self._pending[table]
            set_keys = [k for k, v in items.items() if v is not None]
            values = [v for v in items.values() if v is not None]
            step = COMMAND_ARGS // 2
            for at in range(0, len(set_keys), step):
                commands.append(resp.command(b"HSET", name, *_packed(
                    set_keys[at:at + step], values[at:at + step])))
            dels = self._deletes(table, items)
            for at in range(0, len(dels), COMMAND_ARGS):
                commands.append(resp.command(b"HDEL", name,
                                             *_packed(dels[at:at + COMMAND_ARGS])))
        if self._log or self.trim_below is not None:
            commands.append(resp.command(
                b"EVAL", LOG.encode(), 1, store.keys["log"],
                b"" if self.trim_below is None else f"{self.trim_below}-0".encode(),
                self._log_first, b"".join(self._log)))
        commands += [resp.command(b"SET", store.state_key(name), data)
                     for name, data in self._states.items()]
        store.transact(commands)
        if store._aof:
            store.client.execute_command("WAITAOF", 1, 0, 0)
