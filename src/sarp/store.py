"""The store contract: what an index asks of its storage, the table layouts, and the
write logic every backend shares.  Two backends implement it, side by side:
:mod:`sarp.store_lmdb` (a folder; the only importer of ``lmdb``) and
:mod:`sarp.store_valkey` (a Valkey namespace; the only importer of ``valkey``).
:func:`open_store` picks one by the path's form.  Nothing here imports a client.

Tables (the same keys and values on both backends; integer keys are fixed-width
big-endian, so byte order is numeric order):

``meta``      format version, index id, id and sequence counters (u64 BE each)
``segments``  segment id (u64)  -> segment record (:mod:`sarp.segment`)
``blocks``    block hash (u64)  -> segment id (u32) + offset (u16), LE; never read by ``match``
``holders``   ``n:<instance>\\0<medium>`` -> holder id (u16 BE), ``i:<id>`` -> name, and
              ``s:<id>`` -> the name's checksum (xxh3-64)
``log``       sequence (u64)    -> segment id (u32) + its first hash (u64), LE: every
              segment a write touched, replayed on restart after the snapshot watermark
``aliases``   model root (u64) + engine hash (u64) -> token key (u64): the engine's
              hash of each block of an engine whose blocks are keyed by their tokens
              (:mod:`sarp.tokenkeys`, :mod:`sarp.aliases`); an entry each on Valkey,
              a dump and a journal on LMDB, whose writer holds them in memory
              (:mod:`sarp.aliastable`)

A backend names what it can do in :class:`Capabilities`, which the index and the
packer read instead of probing attributes.
"""

from __future__ import annotations

import os
import re
import struct
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from .errors import CorruptRecordError, DamagedIndexError, FormatVersionError, StoreFullError
from .hashing import checksum_bytes
from .segment import Segment

FORMAT_VERSION = 2  # 2: LMDB's aliases as a dump and a journal (sarp.aliastable)
DURABILITY_MODES = ("sync", "nosync")
MAX_SEGMENT_ID = 0xFFFFFFFF
# A new segment takes the next id that is a multiple of ID_STRIDE, and the ids after it
# are kept for the short tails split off it (Packer._split), so that a tail's record
# sits beside its segment's in key order, on the same page: a match that reaches the
# end of an old chain reads one page, not two (docs/design.md, "Segment ids").
ID_STRIDE = 8
DEFAULT_MAX_READERS = 512
MAX_HOLDERS = 1 << 16  # holder ids are u16 in every segment row
COUNTERS = ("next_seg_id", "next_seq", "log_trimmed_upto", "next_holder_id")
TABLES = ("meta", "segments", "blocks", "holders", "log", "state", "aliases")  # aliases: last

U64 = struct.Struct(">Q")  # meta counters, segment and log keys, block keys
BLOCK_VALUE = struct.Struct("<IH")  # blocks: segment id, offset
BLOCK_DTYPE = np.dtype([("seg", "<u4"), ("off", "<u2")])
LOG_VALUE = struct.Struct("<IQ")  # log: segment id, first hash
LOG_DTYPE = np.dtype([("seg", "<u4"), ("first", "<u8")])  # LOG_VALUE, for numpy
HOLDER_ID = struct.Struct(">H")  # holders: the value of n:<name>, the suffix of i: and s:
T = TypeVar("T")


def is_url(path: object) -> bool:
    """Does ``path`` name a store by URL (``scheme://...``) rather than a folder?

    >>> is_url("valkey://127.0.0.1:6379/ns"), is_url("/var/lib/sarp")
    (True, False)
    """
    return isinstance(path, str) and "://" in path


def hash_keys(hashes: np.ndarray) -> list[bytes]:
    """Big-endian 8-byte keys for a ``uint64`` array (byte order is numeric order).

    >>> hash_keys(np.array([1], np.uint64))
    [b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x01']
    """
    # A void view's tolist() makes the bytes objects in C (an "S8" view would strip
    # trailing zero bytes).
    return hashes.astype(">u8").view("V8").tolist()


def log_arrays(items: list[tuple[bytes, bytes]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Log entries ``(key, value)`` as arrays: ``(seqs int64, segment ids int64, first
    hashes uint64)``; an entry of the wrong size is a :class:`CorruptRecordError`.

    Cost: two joins and three array copies; no Python per entry.

    >>> log_arrays([(U64.pack(3), LOG_VALUE.pack(8, 5))])[1].tolist()
    [8]
    """
    keys = b"".join(map(itemgetter(0), items))
    values = b"".join(map(itemgetter(1), items))
    if len(keys) != U64.size * len(items) or len(values) != LOG_VALUE.size * len(items):
        key, value = next((k, v) for k, v in items
                          if len(k) != U64.size or len(v) != LOG_VALUE.size)
        raise CorruptRecordError(f"log table: an entry of {len(key)}+{len(value)} bytes")
    entries = np.frombuffer(values, LOG_DTYPE)
    return (np.frombuffer(keys, ">u8").astype(np.int64), entries["seg"].astype(np.int64),
            entries["first"].astype(np.uint64))


def counter_value(raw: bytes | None, name: str, where) -> int:
    """A meta counter's stored value (8 bytes big-endian); 0 when absent (a counter
    added after the index was made); ``DamagedIndexError`` naming it when it is not 8
    bytes.

    >>> counter_value(None, "segments", "ix"), counter_value(b"\\0" * 7 + b"\\x05", "n", "ix")
    (0, 5)
    """
    if raw is None:
        return 0
    if len(raw) != U64.size:
        raise DamagedIndexError(f"{where}: meta counter {name!r} is {len(raw)} bytes, not 8; "
                                "the index is damaged: sarp repair can salvage its records")
    return U64.unpack(raw)[0]


def check_int(name: str, value: object, low: int, high: int) -> None:
    """A ValueError naming ``name`` unless ``value`` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r}; pass an int from {low} to {high}")


def check_durability(durability: object) -> str:
    """``durability`` if it is one of :data:`DURABILITY_MODES`, else a ValueError."""
    if durability not in DURABILITY_MODES:
        raise ValueError(
            f"durability={durability!r} is not one of {DURABILITY_MODES}: 'sync' makes every "
            "write durable before it returns (survives power loss), 'nosync' survives a "
            "process crash only")
    return durability


def check_version(raw: bytes | None, where) -> int:
    """The stored format version, refused when this sarp is older than the index."""
    version = counter_value(raw, "format_version", where)
    if version > FORMAT_VERSION:
        raise FormatVersionError(f"{where}: on-disk format {version} is newer than this "
                                 f"sarp's {FORMAT_VERSION}; upgrade sarp to open it")
    return version


def name_sum(name: bytes) -> bytes:
    """The checksum kept beside each holder name (``s:<id>``)."""
    return checksum_bytes(b"sarp-holder:" + name)


def checked_name(value: bytes, stored: bytes | None, sums_required: bool) -> str | None:
    """A holder name that passes its checksum (or predates checksums), else None.

    >>> name = b"w0\\0GPU"
    >>> checked_name(name, name_sum(name), True), checked_name(name, None, True)
    ('w0\\x00GPU', None)
    """
    ok = bytes(stored) == name_sum(value) if stored is not None else not sums_required
    try:
        return value.decode() if ok and b"\0" in value else None
    except UnicodeDecodeError:
        return None


def holder_names(names: Iterable[tuple[bytes, bytes]], sum_of: Callable[[bytes], bytes | None],
                 sums_required: bool) -> dict[int, str | None]:
    """Holder id -> name from the ``i:<id>`` entries ``names`` (key, value) and each
    one's stored sum (``sum_of(packed id)``); None for a name that fails its checksum
    (a damaged name is never reported as holding blocks).  Keys of another length are
    damage: that name is simply not read.  Once every name has its sum (``name_sums``
    in meta), a missing one is damage."""
    return {HOLDER_ID.unpack(key[2:])[0]: checked_name(bytes(value), sum_of(key[2:]),
                                                       sums_required)
            for key, value in names if len(key) == 4}


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, named (the index and the packer read these).

    ``local_reads``: a record read or a block lookup costs about a microsecond (a page
    in this process's map): walks step one read at a time, and the C batch may run
    on the transaction (``WriteTxn.native_calls``).
    ``prefetch``: reads are round trips: a match fetches the records its directory
    predicts in one (``ReadTxn.prefetch``), and a write batches its lookups.
    The C walk runs on either, through ``ReadTxn.native_get`` (local records, or the
    prefetched ones).
    """

    local_reads: bool
    prefetch: bool


class ReadTxn(Protocol):
    """One consistent view (LMDB), or reads that each see every returned write (Valkey;
    the verifier checks every record on its own)."""

    reads: int  # records read for a match (counted by ``record``)
    capabilities: Capabilities  # the store's

    def __enter__(self) -> ReadTxn: ...
    def __exit__(self, *exc: object) -> None: ...
    def record(self, seg_id: int) -> bytes | None: ...
    def segment(self, seg_id: int) -> Segment | None: ...
    def raw_records(self, seg_ids: list[int]) -> list[bytes | None]: ...
    def counter(self, name: str) -> int: ...
    def index_id(self) -> bytes | None: ...
    def log_since(self, seq: int) -> Iterator[tuple[int, int, int]]: ...
    # log_since as arrays (seqs, segment ids, first hashes): store.log_arrays
    def log_arrays(self, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    def raw_segments(self) -> Iterator[tuple[int, bytes]]: ...
    def blocks(self) -> Iterator[tuple[int, int, int]]: ...
    # the aliases' entries read as a writer reads them: a line per damage found
    def aliases_problems(self) -> list[str]: ...
    def holder_names(self) -> dict[int, str | None]: ...
    def stat(self, table: str) -> dict: ...
    # the transaction's get for the walk in C (key: u64 BE segment id), or None
    native_get: Callable[[bytes], bytes | None] | None
    # with capabilities.prefetch: fetch records (and the counters) in one round trip;
    # keys: segment ids as u64 big-endian bytes (Directory.predicted_keys)
    def prefetch(self, keys: list[bytes], with_counters: bool = False) -> None: ...
    def forget_prefetched(self) -> None: ...


class WriteTxn(Protocol):
    """The primitives a write needs (:class:`WriteLogic` builds the rest on them)."""

    capabilities: Capabilities  # the store's

    def counter(self, name: str) -> int: ...
    def set_counter(self, name: str, value: int) -> None: ...
    def put_meta(self, key: bytes, value: bytes) -> None: ...
    def segment(self, seg_id: int) -> Segment: ...
    def segment_exists(self, seg_id: int) -> bool: ...
    def put_segment(self, seg: Segment) -> None: ...
    def delete_segment(self, seg: Segment) -> None: ...
    def locate(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def locate_one(self, block_hash: int) -> tuple[int, int]: ...
    def put_blocks(self, hashes: np.ndarray, seg_id: int, first_offset: int) -> None: ...
    def claim_blocks(self, hashes: np.ndarray, seg_id: int, first_offset: int) -> bool: ...
    # with capabilities.prefetch: the blocks a batch will look up, and the records they
    # name, fetched at once (two round trips) instead of one lookup at a time
    def prefetch_blocks(self, hashes: np.ndarray) -> None: ...
    def prefetch_segments(self, seg_ids: np.ndarray) -> None: ...
    def release_blocks(self, hashes: np.ndarray) -> None: ...
    def log(self, entries: list[tuple[int, int]]) -> None: ...
    def holder_get(self, key: bytes) -> bytes | None: ...
    def holder_put(self, key: bytes, value: bytes | None) -> None: ...
    def holder_items(self, prefix: bytes) -> list[tuple[bytes, bytes]]: ...
    def holder_id(self, name: str, create: bool, reclaim=None) -> int | None: ...
    def forget_holders(self, holder_ids: list[int]) -> None: ...
    def new_segment_id(self) -> int: ...
    def untake_segment_ids(self, first: int) -> None: ...
    # (keys, found) of engine hashes under a model root, aligned with them (key 0: none)
    def alias_get(self, root: int, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    # (of two puts of one alias, in one call or two, the later wins)
    def alias_put(self, roots: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None: ...
    def alias_delete(self, roots: np.ndarray, hashes: np.ndarray) -> None: ...
    # up to ``count`` aliases from ``cursor`` (None: the start) as (roots, hashes, keys),
    # and the next cursor (None: the end was reached)
    def alias_scan(self, cursor, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                      object]: ...
    # a small named value (Store.load_state) replaced with this write, all or nothing
    def put_state(self, name: str, data: bytes) -> None: ...


class Store(Protocol):
    """An index's storage, owned by one writer at a time (any number of readers)."""

    path: object  # what messages name: a folder, or a URL
    durability: str
    readonly: bool
    index_id: bytes
    capabilities: Capabilities
    # a write failed with no answer (the server went away mid-commit): it may have been
    # applied, so the writer's memory is brought to the store before the next write
    maybe_applied: bool

    def read(self) -> ReadTxn: ...
    def write(self, fn: Callable[[WriteTxn], T]) -> T: ...
    def counter(self, name: str) -> int: ...
    def trim_log(self, upto: int) -> None: ...
    def load_snapshot(self): ...
    def save_snapshot(self, watermark: int, directory, holders) -> int: ...
    def load_state(self, name: str) -> bytes | None: ...
    def save_state(self, name: str, data: bytes, durable: bool) -> None: ...
    def disk_bytes(self) -> int: ...
    def memory_bytes(self) -> int: ...  # what it keeps in this process between writes
    def release_dead_readers(self) -> int: ...
    # with capabilities.prefetch: send a reader's next read (counters and the records
    # of these keys) now, its reply taken by that read's prefetch
    def read_ahead(self, keys: list[bytes]) -> None: ...
    def close(self) -> None: ...


def alias_keys(root: int | np.ndarray, hashes: np.ndarray) -> list[bytes]:
    """The ``aliases`` entries' keys on Valkey (16 bytes each, BE) of engine hashes
    under a model root (one, or one per hash).

    >>> alias_keys(1, np.array([2], np.uint64))[0].hex()
    '00000000000000010000000000000002'
    """
    keys = np.empty(hashes.size, dtype=[("root", ">u8"), ("hash", ">u8")])
    keys["root"], keys["hash"] = root, hashes
    return keys.view("V16").tolist()


def alias_columns(entries: Iterable[tuple[bytes, bytes]], where: object, fix: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Aliases kept an entry each (Valkey's, and LMDB's format 1: :func:`alias_keys`
    -> key, BE) as ``(roots, hashes, keys)``; an entry of another size is
    :class:`DamagedIndexError` naming ``where`` and ``fix``.

    >>> alias_columns([(alias_keys(1, np.array([2], np.uint64))[0], bytes(7) + b"\\x03")],
    ...               "x", "")[2].tolist()
    [3]
    """
    items = [(bytes(k), bytes(v)) for k, v in entries]
    if any(len(k) != 16 or len(v) != 8 for k, v in items):
        raise DamagedIndexError(f"{where}: an aliases entry is not 16+8 bytes (model root "
                                f"and engine hash -> token key). {fix}".rstrip())
    pairs = np.frombuffer(b"".join(k for k, _ in items), ">u8").reshape(-1, 2)
    keys = np.frombuffer(b"".join(v for _, v in items), ">u8")
    return (np.ascontiguousarray(pairs[:, 0], np.uint64),
            np.ascontiguousarray(pairs[:, 1], np.uint64), keys.astype(np.uint64))


class WriteLogic:
    """What a write does the same way on every store, over a backend's primitives
    (``counter``, ``set_counter``, ``put_meta``, ``segment_exists``, ``holder_get``,
    ``holder_put``, ``holder_items``) and ``_store.path``."""

    __slots__ = ()

    def prefetch_blocks(self, hashes: np.ndarray) -> None:
        """Nothing to do where lookups are page reads (``capabilities.prefetch`` off; a
        store with it overrides this and :meth:`prefetch_segments`)."""

    def prefetch_segments(self, seg_ids: np.ndarray) -> None:
        """Nothing to do, as :meth:`prefetch_blocks`."""

    def raw_tables(self) -> tuple | None:
        """None: the packer's C calls ``native_calls``' methods (LMDB's override gives
        it liblmdb's own calls)."""
        return None

    def create_meta(self) -> None:
        """A new index's meta: format version, a new index id, zero counters, and the
        mark that every holder name has its checksum."""
        self.set_counter("format_version", FORMAT_VERSION)
        self.put_meta(b"index_id", uuid.uuid4().bytes)
        for name in COUNTERS:
            self.set_counter(name, 0)
        self.set_counter("name_sums", 1)

    def add_missing_name_sums(self) -> None:
        """Indexes written before name checksums get them at the writer's next open."""
        for key, value in self.holder_items(b"i:"):
            if self.holder_get(b"s:" + key[2:]) is None:
                self.holder_put(b"s:" + key[2:], name_sum(value))
        self.set_counter("name_sums", 1)

    def new_segment_id(self) -> int:
        """The next multiple of ``ID_STRIDE``; the ids up to the one before the next
        multiple are kept for tails split off it (:meth:`tail_segment_id`)."""
        seg_id = (self.counter("next_seg_id") // ID_STRIDE + 1) * ID_STRIDE
        if seg_id + ID_STRIDE - 1 > MAX_SEGMENT_ID:
            raise StoreFullError(f"{self._store.path}: segment ids exhausted ({MAX_SEGMENT_ID})")
        self.set_counter("next_seg_id", seg_id + ID_STRIDE - 1)
        return seg_id

    def untake_segment_ids(self, first: int) -> None:
        """Give back the ids :meth:`new_segment_id` gave from ``first`` on (an insert
        that took them and then found one of its blocks stored)."""
        self.set_counter("next_seg_id", first - 1)

    def tail_segment_id(self, seg_id: int, taken: Callable[[int], bool]) -> int:
        """An id for a tail split off segment ``seg_id``: the first of the ids kept
        after it that no record has and ``taken`` (this write's segments) does not
        hold, so that the tail's record sits beside its segment's; else a new id.

        An id whose segment was deleted is taken again: everything that keeps ids
        (the directory, the filters, a reader's replay of the log) reads the record
        the id names now, and the verifier checks every record it uses.
        Cost: one ``segments`` read per id tried, at most ``ID_STRIDE - 1``.
        """
        if seg_id % ID_STRIDE == 0:
            for candidate in range(seg_id + 1, seg_id + ID_STRIDE):
                if not taken(candidate) and not self.segment_exists(candidate):
                    return candidate
        return self.new_segment_id()

    def take_seqs(self, count: int) -> int:
        """Reserve ``count`` log sequence numbers; return the first."""
        first = self.counter("next_seq") + 1
        self.set_counter("next_seq", first + count - 1)
        return first

    def holder_id(self, name: str, create: bool, reclaim=None) -> int | None:
        """The id of holder ``name``; with ``create``, a new one if it has none.

        Ids are u16 (they are stored per row of every segment).  When all are taken,
        ``reclaim()`` names an id whose holder holds nothing (an engine that was
        cleared and went away); its old name is forgotten and the id reused.
        """
        key = b"n:" + name.encode()
        value = self.holder_get(key)
        if value is not None:
            return HOLDER_ID.unpack(value)[0]
        if not create:
            return None
        new_id = self.counter("next_holder_id")
        if new_id < MAX_HOLDERS:
            self.set_counter("next_holder_id", new_id + 1)
        else:
            new_id = reclaim() if reclaim is not None else None
            if new_id is None:
                raise StoreFullError(
                    f"{self._store.path}: {MAX_HOLDERS} holders hold blocks; clear the ones "
                    "whose engines are gone (index.clear(NAME)) so their ids can be reused")
            self.forget_holders([new_id])
        packed = HOLDER_ID.pack(new_id)
        self.holder_put(key, packed)
        self.holder_put(b"i:" + packed, name.encode())
        self.holder_put(b"s:" + packed, name_sum(name.encode()))
        self.set_counter("holder_changes", self.counter("holder_changes") + 1)
        return new_id

    def new_holder_id(self, name: str) -> int | None:
        """A new id for ``name``, or None when every id is taken (the caller reclaims)."""
        if self.counter("next_holder_id") >= MAX_HOLDERS:
            return None
        return self.holder_id(name, create=True)

    def forget_holders(self, holder_ids: list[int]) -> None:
        """Delete the name entries of ``holder_ids`` (both directions); ids are not reused
        except by :meth:`holder_id`'s reclaim."""
        wanted = {HOLDER_ID.pack(h) for h in holder_ids}
        for key, value in self.holder_items(b"n:"):
            if value in wanted:
                self.holder_put(key, None)
        for packed in wanted:
            self.holder_put(b"i:" + packed, None)
            self.holder_put(b"s:" + packed, None)
        self.set_counter("holder_changes", self.counter("holder_changes") + 1)


def open_store(path: str | os.PathLike, *, durability: str = "sync", create: bool = True,
               readonly: bool = False, map_size_bytes: int = 1 << 36,
               max_readers: int = DEFAULT_MAX_READERS, lease_s: float = 10.0,
               wait_for_lease_s: float = 0.0) -> Store:
    """The store at ``path``: a folder (LMDB) or ``valkey://HOST:PORT/NAMESPACE`` (also
    ``redis://``, ``rediss://``, ``valkeys://``).  The Valkey client is imported only
    when a URL asks for it.  Options a backend does not have are ignored by it
    (``map_size_bytes``, ``max_readers``: LMDB; ``lease_s``, ``wait_for_lease_s``:
    Valkey).  Cost: the backend's open.

    >>> import tempfile
    >>> store = open_store(tempfile.mkdtemp())
    >>> store.capabilities.local_reads, store.counter("next_seq")
    (True, 0)
    >>> store.close()
    """
    check_durability(durability)
    if not is_url(path):
        refuse_lost_slashes(os.fspath(path))
    if is_url(path):
        from .store_valkey import ValkeyStore

        return ValkeyStore(path, durability=durability, create=create, readonly=readonly,
                           lease_s=lease_s, wait_for_lease_s=wait_for_lease_s)
    from .store_lmdb import LmdbStore

    return LmdbStore(path, durability=durability, map_size_bytes=map_size_bytes,
                     create=create, readonly=readonly, max_readers=max_readers)


SHARD_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


def check_shard_name(shard: object) -> None:
    """ValueError naming the fix unless ``shard`` is a shard's name.

    >>> check_shard_name("a b")
    Traceback (most recent call last):
      ...
    ValueError: shard='a b': a shard's name is 1 to 32 characters from [A-Za-z0-9_-], e.g. shard='a'
    """
    if not isinstance(shard, str) or not SHARD_NAME.fullmatch(shard):
        raise ValueError(f"shard={shard!r}: a shard's name is 1 to 32 characters from "
                         "[A-Za-z0-9_-], e.g. shard='a'")


def _shards_on_valkey(path: str | os.PathLike) -> None:
    if not is_url(path):
        raise ValueError(f"{os.fspath(path)!r}: shards are namespaces of a Valkey server "
                         "or cluster; pass valkey://HOST:PORT/NAMESPACE")


def shard_location(path: str | os.PathLike, shard: str, *, create: bool = True) -> str:
    """The location of shard ``shard`` of the sharded index at ``path`` (a Valkey URL):
    see :func:`sarp.valkey_shards.shard_url`.  ValueError for a folder."""
    _shards_on_valkey(path)
    from .valkey_shards import shard_url

    return shard_url(os.fspath(path), shard, create=create)


def shard_registry(path: str | os.PathLike):
    """The registry of the shards under ``path`` (a Valkey URL): ``.shards()`` gives
    name -> location, ``.close()`` lets it go (:class:`sarp.valkey_shards.ShardRegistry`)."""
    _shards_on_valkey(path)
    from .valkey_shards import ShardRegistry

    return ShardRegistry(os.fspath(path))


def shard_locations(path: str | os.PathLike) -> dict[str, str]:
    """The shards registered under ``path`` (a Valkey URL): name -> location."""
    registry = shard_registry(path)
    try:
        return registry.shards()
    finally:
        registry.close()


SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}  # -> TLS


PASSWORD_ENV = "SARP_VALKEY_PASSWORD"


NAMESPACE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def refuse_lost_slashes(text: str) -> None:
    """ValueError for a folder path that is a store URL without its ``//``.

    >>> refuse_lost_slashes("/var/lib/sarp")
    """
    scheme, colon, _ = text.partition(":")
    if colon and scheme.lower() in SCHEMES:
        raise ValueError(f"{text!r} looks like a {scheme} URL without its '//'; write "
                         f"{scheme}://HOST:PORT/NAMESPACE (or ./{text} for a folder)")


def check_location(text: str, create: bool = True) -> None:
    """ValueError naming the fix unless ``text`` is a usable index location: a
    ``valkey://`` URL, an index folder, or (with ``create``) a folder that can be made,
    its nearest existing parent a folder this user may write.  A folder named like a
    URL that lost a slash (``valkey:/HOST...``) is refused rather than made.

    Cost: a few ``stat`` calls; nothing is created.

    >>> try:
    ...     check_location("valkey:/127.0.0.1:6379/ns")
    ... except ValueError as exc:
    ...     print(str(exc)[:59])
    'valkey:/127.0.0.1:6379/ns' looks like a valkey URL without
    """
    if is_url(text):
        parse_url(text)
        return
    refuse_lost_slashes(text)
    path = Path(text)
    if not create or path.exists():
        if path.exists() and not path.is_dir():
            raise ValueError(f"{text!r} is a file; pass a folder for the index")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{text!r}: {parent} is a file, so the folder cannot be made there; "
                         "pass a path under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{text!r}: this user may not make folders in {parent}; pass a path "
                         "it may write, or make the folder first")


def parse_url(url: str) -> dict:
    """Connection settings and namespace of a ``valkey://`` URL; ValueError names the fix.

    >>> parse_url("valkey://127.0.0.1:6390/prod")["namespace"]
    'prod'
    """
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"{url!r}: unknown scheme {scheme!r}; pass a folder path, or "
            "valkey://HOST:PORT/NAMESPACE (also redis://, and rediss:// or valkeys:// with TLS)")
    namespace = parts.path.lstrip("/")
    if not NAMESPACE.fullmatch(namespace):
        raise ValueError(
            f"{url!r}: the namespace {namespace!r} must be 1 to 64 characters from "
            "[A-Za-z0-9_.:-], e.g. valkey://127.0.0.1:6379/kv-index")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"{url!r}: the port is not a number; e.g. valkey://HOST:6379/NS") from None
    return {"host": parts.hostname or "127.0.0.1", "port": port, "namespace": namespace,
            "username": urllib.parse.unquote(parts.username) if parts.username else None,
            "password": urllib.parse.unquote(parts.password) if parts.password
            else os.environ.get(PASSWORD_ENV), "ssl": SCHEMES[scheme]}
