"""Serving-engine KV cache events, as they are on the wire: decoding and applying.

What the engines send (read from the ``kv_events`` modules of vLLM 0.9.2 to 0.33
and SGLang 0.5.x; msgspec structs encoded with msgpack):

* the batch is always positional, ``[ts, [event, ...], dp_rank]`` (vLLM's
  ``data_parallel_rank``, SGLang's ``attn_dp_rank``; vLLM omits it when it is
  None, SGLang sends it as nil);
* an event is a tagged array in vLLM up to 0.11 (``["BlockStored",
  block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name?, ...]``, ``["BlockRemoved", block_hashes, medium?]``,
  ``["AllBlocksCleared"]``) and a tagged map from vLLM 0.12 and in SGLang 0.5.x
  (``{"type": "BlockStored", "block_hashes": ..., ...}``, fields left at their
  default omitted, ``group_idx`` from vLLM 0.33).

A batch sent as a map (``{"ts", "events", "data_parallel_rank"}``) is accepted too,
for publishers that encode it that way.  Hashes are uint64 ints (vLLM), signed
int64 (SGLang) or bytes (vLLM with int hashes off: the low 64 bits, big-endian).
Media names are mapped to canonical tiers (:mod:`sarp.serving.media`).

A payload whose batch cannot be read is a :class:`BadEvent` (a ``SarpError``),
raised before anything is applied.  One bad event inside a readable batch does
not spoil the others: it decodes to a :class:`Malformed` naming its kind, and
:func:`apply` counts it and applies the rest.  This is the only module that
imports msgpack (pyzmq enters through :mod:`sarp.serving.subscriber`, and through
:mod:`sarp.bench.cluster` for the simulated engines).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np

from .. import native
from ..errors import (
    ChainConflictError,
    IndexClosedError,
    ParentNotFoundError,
    SarpError,
    StoreError,
)
from ..hashing import as_hash, as_hashes, repeats
from ..holders import DEFAULT_MEDIUM
from .media import canonical_medium, is_valid_medium

log = logging.getLogger("sarp.events")

MAX_DP_RANK = 4095  # engines run a few to a few hundred ranks; more is a broken frame


class BadEvent(SarpError, ValueError):
    """A payload that is not a KV event batch; the message says what is wrong."""


# Stored, Removed and Batch are built for every event on the ingest path, where a frozen
# dataclass's __init__ (object.__setattr__ per field) costs about 3x a plain one's.
@dataclass(slots=True)
class Stored:
    block_hashes: np.ndarray
    parent: int | None
    medium: str = DEFAULT_MEDIUM
    lora_name: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class Removed:
    block_hashes: np.ndarray
    medium: str = DEFAULT_MEDIUM
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


@dataclass(frozen=True, slots=True)
class Malformed:
    """An event of a readable batch that cannot be applied as sent.

    ``kind`` names the fault (``malformed``, ``unknown_type``, ``bad_hashes``,
    ``repeated_hash``, ``parent_in_chain``, ``bad_medium``, ``bad_group``);
    ``block_hashes`` are kept for a removal whose hashes could be read, so that
    :func:`apply` can still drop those blocks.
    """

    kind: str
    reason: str
    event_type: str | None = None
    block_hashes: np.ndarray | None = None


Event = Stored | Removed | Cleared | Malformed


@dataclass(slots=True)
class Batch:
    ts: float
    events: list[Event] = field(default_factory=list)
    dp_rank: int | None = None


def decode(payload: bytes) -> Batch:
    """Decode one msgpack payload into a :class:`Batch`, or raise :class:`BadEvent`.

    Only a batch that cannot be read raises; a bad event inside a readable batch
    becomes a :class:`Malformed` in ``events``.

    >>> raw = msgpack.packb([1.5, [["BlockStored", [7, 8], None, [], 16, None, "GPU"]]])
    >>> decode(raw).events[0].block_hashes.tolist()
    [7, 8]
    >>> decode(msgpack.packb([1.5, [{"type": "BlockStored", "block_hashes": [7, 7],
    ...     "parent_block_hash": None}]])).events[0].kind
    'repeated_hash'
    """
    c = native.C
    if c is not None:
        batch = _from_native(c.decode_batch(payload))
        if batch is not None:
            return batch
    else:
        native.ran_python("decode_batch")
    batch = _decode_common(payload)
    return batch if batch is not None else _decode_full(payload)


_MEDIA: dict[str, str | None] = {}  # a medium as sent -> canonical, or None if invalid
_MEDIA_CACHED = 1024  # engines send a handful; a stream of odd names is not cached


def _canonical(medium: str | None) -> str | None:
    if medium is None:
        return DEFAULT_MEDIUM
    known = _MEDIA.get(medium, False)
    if known is False:
        known = canonical_medium(medium) if is_valid_medium(medium) else None
        if len(_MEDIA) < _MEDIA_CACHED:
            _MEDIA[medium] = known
    return known


def _from_native(got: tuple | None) -> Batch | None:
    """The batch ``sarp._native.decode_batch`` read (the shape engines send, every
    field valid but the medium's name, checked here), or None: decode in Python."""
    if got is None:
        return None
    ts, dp_rank, raw = got
    events: list[Event] = []
    for e in raw:
        if e[0] == "BlockStored":
            medium = _canonical(e[3])
            if medium is None:
                return None
            events.append(Stored(np.frombuffer(e[1], np.uint64), e[2], medium, e[4], e[5]))
        elif e[0] == "BlockRemoved":
            medium = _canonical(e[2])
            if medium is None:
                return None
            events.append(Removed(np.frombuffer(e[1], np.uint64), medium, e[3]))
        else:
            events.append(Cleared())
    return Batch(ts, events, dp_rank)


def _decode_full(payload: bytes) -> Batch:
    """:func:`decode` of any payload, building every object in it."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise BadEvent(f"not msgpack ({type(exc).__name__}: {exc})") from None
    try:
        return _batch(obj)
    except BadEvent:
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
        raise BadEvent(f"malformed event batch: {exc}") from None


# Fields of a store that sarp never reads and that make most of its bytes (16 or so
# token ids per block): the streaming decode reads past them without building them.
_SKIPPED = frozenset({"token_ids", "extra_keys"})
_ARRAY_TYPES = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])  # msgpack array headers
_MAP_TYPES = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])  # and map headers


def _decode_common(payload: bytes) -> Batch | None:
    """:func:`decode` for the shape engines send, a ``[ts, events(, dp_rank)]`` array of
    tagged-array or map events, reading past token ids instead of building a Python
    int for each (they are most of a store's bytes).  None for anything else or
    anything wrong, and the caller decodes the whole payload: so the answer is the one
    the full decode gives, except that the fields read past are not checked (text in
    them that is not UTF-8 does not sink the batch).

    Cost: a few method calls per field, none per token.
    """
    try:
        # sized to the payload: the default 100 MiB buffer raised BufferFull outside
        # any handler on a larger frame, which stopped serve
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False,
                                    max_buffer_size=max(len(payload), 1))
        unpacker.feed(payload)
        if payload[0] not in _ARRAY_TYPES:
            return None
        size = unpacker.read_array_header()
        if not 2 <= size <= 3:
            return None
        ts = unpacker.unpack()
        if payload[unpacker.tell()] not in _ARRAY_TYPES:
            return None
        events = []
        for _ in range(unpacker.read_array_header()):
            event = _event_streamed(unpacker, payload)
            if event is None:
                return None
            events.append(event)
        dp_rank = unpacker.unpack() if size == 3 else None
        if unpacker.tell() != len(payload):
            return None
    except Exception:  # msgpack raises several unrelated types on bad input
        return None
    if (not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts)
            or (dp_rank is not None and (not isinstance(dp_rank, int)
                                         or isinstance(dp_rank, bool)
                                         or not 0 <= dp_rank <= MAX_DP_RANK))):
        return None  # the full decode says what is wrong
    return Batch(float(ts), events, dp_rank)


def _event_streamed(unpacker: msgpack.Unpacker, payload: bytes) -> Event | None:
    """The next event, with the fields the full decode would give it but the skipped
    ones; None when it is neither a non-empty array nor a map."""
    head = payload[unpacker.tell()]
    fields: dict = {}
    if head in _ARRAY_TYPES:
        count = unpacker.read_array_header()
        if not count:
            return None
        kind = unpacker.unpack()
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(
            kind, ()) if isinstance(kind, str) else ()
        for i in range(count - 1):
            name = names[i] if i < len(names) else None
            if name is None or name in _SKIPPED:
                unpacker.skip()
            else:
                fields[name] = unpacker.unpack()
    elif head in _MAP_TYPES:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in _SKIPPED:
                unpacker.skip()
            else:
                fields[key] = unpacker.unpack()
        kind = fields.get("type")
    else:
        return None
    return _checked_event(kind, fields)


def _batch(obj: object) -> Batch:
    if isinstance(obj, dict):
        ts, events = obj.get("ts"), obj.get("events")
        dp_rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
    elif isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        dp_rank = obj[2] if len(obj) > 2 else None
    else:
        raise BadEvent(f"a batch is a [ts, events, dp_rank] array, got {_show(obj)}")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise BadEvent(f"batch ts must be a finite number, got {_show(ts)}")
    if not isinstance(events, list | tuple):
        raise BadEvent(f"batch events must be an array, got {_show(events)}")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool)
                                or not 0 <= dp_rank <= MAX_DP_RANK):
        raise BadEvent(f"dp rank must be an int from 0 to {MAX_DP_RANK}, got {_show(dp_rank)}")
    return Batch(float(ts), [_event_or_malformed(e) for e in events], dp_rank)


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class _Fault(Exception):
    def __init__(self, kind: str, reason: str, hashes: np.ndarray | None = None) -> None:
        super().__init__(reason)
        self.kind, self.reason, self.hashes = kind, reason, hashes


def _event_or_malformed(obj: object) -> Event:
    if isinstance(obj, dict):
        return _checked_event(obj.get("type"), obj)
    if isinstance(obj, list | tuple) and obj:
        kind = obj[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(
            kind, ()) if isinstance(kind, str) else ()
        return _checked_event(kind, dict(zip(names, obj[1:], strict=False)))
    return Malformed("malformed", f"an event is a tagged array or map, got {_show(obj)}", None)


def _checked_event(kind: object, fields: dict) -> Event:
    """The event ``kind`` with ``fields``, or a :class:`Malformed` saying what is wrong."""
    try:
        return _event(kind, fields)
    except _Fault as fault:
        return Malformed(fault.kind, fault.reason, kind if isinstance(kind, str) else None,
                         fault.hashes)
    except (TypeError, ValueError, OverflowError) as exc:
        return Malformed("malformed", str(exc), kind if isinstance(kind, str) else None)


def _event(kind: object, fields: dict) -> Event:
    if kind == "AllBlocksCleared":
        return Cleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        raise _Fault("unknown_type", f"unknown event type {_show(kind)}")
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list | tuple) or not hashes:
        raise _Fault("bad_hashes", f"{kind}.block_hashes must be a non-empty array, "
                                   f"got {_show(hashes)}")
    try:
        block_hashes = as_hashes(hashes, name=f"{kind}.block_hashes")
    except (TypeError, ValueError, OverflowError) as exc:
        raise _Fault("bad_hashes", str(exc)) from None
    salvage = block_hashes if kind == "BlockRemoved" else None
    medium = fields.get("medium")
    medium = DEFAULT_MEDIUM if medium is None else medium
    if not is_valid_medium(medium):
        raise _Fault("bad_medium", f"{kind}.medium must be 1-32 letters, digits or _.:-, "
                                   f"got {_show(medium)}", salvage)
    group_idx = fields.get("group_idx")
    if group_idx is not None and (not isinstance(group_idx, int) or isinstance(group_idx, bool)):
        raise _Fault("bad_group", f"{kind}.group_idx must be an int, got {_show(group_idx)}",
                     salvage)
    medium = canonical_medium(medium)
    if kind == "BlockRemoved":
        return Removed(block_hashes, medium, group_idx)
    parent = fields.get("parent_block_hash")
    try:
        parent_hash = None if parent is None else as_hash(parent,
                                                          name="BlockStored.parent_block_hash")
    except (TypeError, ValueError) as exc:
        raise _Fault("bad_hashes", str(exc)) from None
    fault = repeats(block_hashes, parent_hash)
    if fault == "repeat":
        raise _Fault("repeated_hash", "BlockStored.block_hashes repeat a value")
    if fault == "parent":
        raise _Fault("parent_in_chain", "BlockStored.parent_block_hash is one of its own "
                                        "block_hashes")
    lora_name = fields.get("lora_name")
    if lora_name is not None and not isinstance(lora_name, str):
        raise _Fault("malformed", f"BlockStored.lora_name must be a string, got "
                                  f"{_show(lora_name)}")
    return Stored(block_hashes, parent_hash, medium, lora_name, group_idx)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def holder_name(source: str, dp_rank: int | None) -> str:
    """The holder a source's blocks are stored under: ``NAME``, or ``NAME#r`` per DP rank.

    Real publishers always send a rank (vLLM and SGLang send 0 without data
    parallelism), so engines followed by ``sarp serve`` appear as ``NAME#r``.

    >>> holder_name("w3", None), holder_name("w3", 1)
    ('w3', 'w3#1')
    """
    return source if dp_rank is None else f"{source}#{dp_rank}"


@dataclass(slots=True)
class ApplyStats:
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    skipped_orphans: int = 0  # stores whose parent is not held (an event was lost)
    skipped_groups: int = 0  # events for KV cache groups other than the first
    bad_events: Counter = field(default_factory=Counter)  # skipped, by kind
    seconds: float = 0.0  # time spent applying


class RateLimitedLog:
    """Warnings about faults from outside, one per (who, kind) at first sight and then
    at most one per ``interval_s``, each saying how many were held back since.

    Cost: a dict lookup per warning.

    >>> RateLimitedLog(log).warn("e0", "bad_frame", "sarp: e0 sent a bad frame")
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger, self.interval_s = logger, interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: Counter = Counter()

    def warn(self, who: str, kind: str, message: str) -> None:
        key, now = (who, kind), time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] += 1
            return
        if len(self._last) > 100_000:  # a stream of new names must not grow it for ever
            self._last.clear()
        more = self._suppressed.pop(key, 0)
        self._last[key] = now
        self.logger.warning("%s%s", message,
                            f" ({more} more like it since the last report)" if more else "")


_bad_event_log = RateLimitedLog(log)


def apply(index, source: str, batch: Batch, stats: ApplyStats | None = None, *,
          dp_rank: int | None = None) -> ApplyStats:
    """Apply a decoded batch from engine ``source`` to ``index`` (one index batch).

    ``BlockStored`` -> ``insert`` under holder ``source#rank`` (``dp_rank`` when
    given, else the batch's rank; plain ``source`` when neither) and the event's
    medium; ``BlockRemoved`` -> ``remove``; ``AllBlocksCleared`` -> ``clear`` of that
    holder in every medium.  Only KV cache group 0 (or events without a group) is
    applied; see ``skipped_groups``.

    A bad event never stops the batch.  It is counted in ``bad_events`` by kind,
    logged (rate-limited) and skipped, keeping the index on the side of knowing
    less than the engine: a store that cannot be applied is not stored (a store
    whose parent is not held is ``skipped_orphans``); a removal that cannot be
    applied as sent drops its blocks from every medium of the holder, or, when
    even its hashes cannot be read, clears the holder.  Errors of the store
    itself (``StoreError``) are not bad events and propagate.

    Cost: one index write transaction (see :class:`Applier` for many batches in one).

    >>> import tempfile, sarp
    >>> with sarp.open(tempfile.mkdtemp()) as index:
    ...     s = apply(index, "e0", decode(encode_batch([("stored", [5, 6, 5], None, "GPU"),
    ...                                                 ("stored", [1, 2], None, "GPU")])))
    ...     dict(s.bad_events), index.match([1, 2]).by_holder
    ({'repeated_hash': 1}, {'e0': 2})
    """
    stats = stats or ApplyStats()
    applier = Applier(index)
    applier.add(source, batch, stats, dp_rank=dp_rank)
    applier.flush()
    return stats


class Applier:
    """Turns decoded batches into index operations and applies many in one transaction.

    ``add`` queues a batch's events; ``flush`` applies everything queued with one
    :meth:`sarp.Index.apply_batch` (one commit, each touched segment written once)
    and settles the counts: what was stored and removed, and each refused
    operation as a bad event or an orphan.  A removal the index refused is
    followed, in a second batch, by a clear of its holder (never more than the
    engine).

    Cost: one write transaction per flush.
    """

    def __init__(self, index) -> None:
        self.index = index
        self._ops: list[tuple] = []
        self._meta: list[tuple[ApplyStats, str, str]] = []  # per op: stats, holder, kind
        self._batches: list[ApplyStats] = []

    @property
    def pending_ops(self) -> int:
        return len(self._ops)

    def discard(self) -> None:
        """Drop everything queued (a write failed: the batches are asked for again)."""
        self._ops, self._meta, self._batches = [], [], []

    def add(self, source: str, batch: Batch, stats: ApplyStats, *,
            dp_rank: int | None = None) -> None:
        """Queue a decoded batch's events (nothing is written until :meth:`flush`)."""
        holder = holder_name(source, batch.dp_rank if dp_rank is None else dp_rank)
        for event in batch.events:
            stats.events += 1
            if getattr(event, "group_idx", None) not in (None, 0):
                # Hybrid models report each KV cache group separately; a block counts as
                # cached when group 0 (full attention) has it, so other groups' events
                # could only make the index claim blocks group 0 does not hold.
                stats.skipped_groups += 1
            elif isinstance(event, Stored):
                self._queue(stats, holder, "store",
                            ("insert", event.block_hashes, event.parent, holder, event.medium))
            elif isinstance(event, Removed):
                self._queue(stats, holder, "remove",
                            ("remove", event.block_hashes, holder, event.medium))
            elif isinstance(event, Cleared):
                self._queue(stats, holder, "clear", ("clear", holder, None))
            else:
                self._add_malformed(stats, holder, event)
        self._batches.append(stats)

    def _queue(self, stats: ApplyStats, holder: str, kind: str, op: tuple) -> None:
        self._ops.append(op)
        self._meta.append((stats, holder, kind))

    def _add_malformed(self, stats: ApplyStats, holder: str, event: Malformed) -> None:
        _bad(stats, holder, event.kind, event.reason)
        if event.event_type != "BlockRemoved":
            return  # a store not applied, or an event we do not know: the index knows less
        if event.block_hashes is None:
            # A removal of blocks we cannot name: only forgetting the holder is safe.
            self._queue(stats, holder, "clear", ("clear", holder, None))
            return
        for medium in self._media_of(holder):
            self._queue(stats, holder, "remove", ("remove", event.block_hashes, holder, medium))

    def _media_of(self, holder: str) -> list[str]:
        known = {m for inst, m in self.index.holders_list() if inst == holder}
        queued = {op[4] for op in self._ops if op[0] == "insert" and op[3] == holder}
        return sorted(known | queued | {DEFAULT_MEDIUM})

    def flush(self) -> None:
        """Apply everything queued in one index batch; settle the counts."""
        if not self._ops and not self._batches:
            return
        started = time.perf_counter()
        ops, meta, batches = self._ops, self._meta, self._batches
        self._ops, self._meta, self._batches = [], [], []
        try:
            result = self.index.apply_decoded(ops)  # decode checked the hashes
        except (StoreError, IndexClosedError):
            raise  # the store itself failed: not the events' fault, nothing to skip
        except Exception as exc:  # a bug of ours must not stop the stream either
            log.exception("sarp: applying a batch of %d operations failed", len(ops))
            self._after_internal_error(ops, meta, exc)
        else:
            self._settle(ops, meta, result)
        share = (time.perf_counter() - started) / max(1, len(batches))
        for stats in batches:
            stats.seconds += share  # apply time, split evenly over the batches applied
            stats.batches += 1

    def _settle(self, ops: list[tuple], meta: list, result) -> None:
        failed = dict(result.failed)
        fallback: list[tuple] = []
        media: dict[str, list[str]] = {}  # a holder's media, read once
        for i, (op, (stats, holder, kind)) in enumerate(zip(ops, meta, strict=True)):
            exc = failed.get(i)
            if exc is None:
                if kind == "store":
                    stats.blocks_stored += op[1].size
                elif kind == "remove":
                    stats.blocks_removed += result.removed_per_op[i]
                else:
                    stats.clears += 1
                    stats.blocks_removed += result.removed_per_op[i]
            elif kind == "store":
                if isinstance(exc, ParentNotFoundError):
                    stats.skipped_orphans += 1
                else:
                    _bad(stats, holder, "chain_conflict" if isinstance(exc, ChainConflictError)
                         else "rejected", str(exc))
                # A refused store's hashes may name other blocks than the index's (hashes
                # the engine did not chain), and a later store may hang under them: the
                # holder lets go of them, so nothing can be claimed below them.
                if holder not in media:
                    media[holder] = self._media_of(holder)
                fallback.extend(("remove", op[1], holder, medium) for medium in media[holder])
            else:
                _bad(stats, holder, "rejected", str(exc))
                fallback.append(("clear", holder, None))
        if fallback:
            self.index.apply_batch(fallback)

    def _after_internal_error(self, ops: list[tuple], meta: list, exc: Exception) -> None:
        forget = set()
        for _op, (stats, holder, kind) in zip(ops, meta, strict=True):
            _bad(stats, holder, "internal_error", repr(exc))
            if kind != "store":
                forget.add(holder)  # it may have been a removal: only forgetting is safe
        if forget:
            self.index.apply_batch([("clear", h, None) for h in sorted(forget)])


def _bad(stats: ApplyStats, holder: str, kind: str, reason: str) -> None:
    stats.bad_events[kind] += 1
    _bad_event_log.warn(holder, kind, f"sarp: {holder}: skipped a bad event ({kind}): {reason}")


def encode_batch(
    events: Sequence[tuple],
    *,
    ts: float = 0.0,
    dp_rank: int | None = None,
    style: str = "vllm-0.11",
) -> bytes:
    """Encode a batch exactly as an engine does (for the simulated cluster and tests).

    ``events`` are ``("stored", hashes, parent, medium)``, ``("removed", hashes,
    medium)`` or ``("cleared",)`` (a stored or removed tuple may end with a
    ``group_idx``).  ``style`` picks the engine's encoding: ``"vllm-0.11"``
    (positional batch, tagged-array events: vLLM 0.9 to 0.11), ``"vllm-0.33"``
    (positional batch, tagged-map events with default fields omitted: vLLM 0.12
    on) or ``"sglang"`` (positional batch with ``attn_dp_rank`` always present,
    tagged maps, hashes as signed int64).

    >>> decode(encode_batch([("cleared",)], style="sglang")).events
    [Cleared()]
    """
    if style not in ENCODING_STYLES:
        raise ValueError(f"style={style!r}; pick one of {ENCODING_STYLES}")
    out = [_encode_event(e, style) for e in events]
    if style == "sglang":
        return msgpack.packb([ts, out, dp_rank])
    return msgpack.packb([ts, out] + ([dp_rank] if dp_rank is not None else []))


ENCODING_STYLES = ("vllm-0.11", "vllm-0.33", "sglang")


BLOCK_SIZE = 16  # tokens per block in the events encode_batch makes


def _tokens_of(hashes) -> list[int]:
    """Token ids for the stored blocks, ``BLOCK_SIZE`` per block, as engines send them
    (the payload's bulk; the index never reads them).  Made up from the hashes: ids
    below 2**17, like a real vocabulary's."""
    h = np.repeat(np.asarray([int(x) for x in hashes], np.uint64), BLOCK_SIZE)
    shifts = np.tile(np.arange(BLOCK_SIZE, dtype=np.uint64) * np.uint64(3), len(hashes))
    return ((h >> shifts) & np.uint64(0x1FFFF)).tolist()


def _encode_event(e: tuple, style: str) -> object:
    def ints(hashes) -> list[int]:
        values = [int(h) for h in hashes]
        return [v - 2**64 if v >= 2**63 else v for v in values] if style == "sglang" else values

    if e[0] == "cleared":
        return {"type": "AllBlocksCleared"} if style != "vllm-0.11" else ["AllBlocksCleared"]
    if e[0] == "stored":
        parent = None if e[2] is None else ints([e[2]])[0]
        group = e[4] if len(e) > 4 else None
        tokens = _tokens_of(e[1])
        if style == "vllm-0.11":
            return ["BlockStored", ints(e[1]), parent, tokens, BLOCK_SIZE, None, e[3], None]
        event = {"type": "BlockStored", "block_hashes": ints(e[1]), "parent_block_hash": parent,
                 "token_ids": tokens, "block_size": BLOCK_SIZE, "lora_id": None,
                 "medium": e[3]}
        if style == "vllm-0.33":
            event["lora_name"] = None
        if group is not None:
            event["group_idx"] = group
        return event
    group = e[3] if len(e) > 3 else None
    if style == "vllm-0.11":
        return ["BlockRemoved", ints(e[1]), e[2]]
    event = {"type": "BlockRemoved", "block_hashes": ints(e[1]), "medium": e[2]}
    if group is not None:
        event["group_idx"] = group
    return event
