"""Serving-engine KV cache events, as they are on the wire: decoding and applying.

vLLM publishes a ``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events, msgpack-encoded, in one of two shapes in use:

* positional (older vLLM, msgspec ``array_like``): the batch is
  ``[ts, [event, ...], data_parallel_rank?]`` and an event is
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name?, ...]``, ``["BlockRemoved", block_hashes, medium?,
  ...]`` or ``["AllBlocksCleared"]``;
* keyed (newer vLLM): the batch is a map ``{"ts", "events",
  "data_parallel_rank"?}`` and an event a map tagged ``{"type": "BlockStored",
  ...}``.

Hashes are uint64 ints (vLLM), signed int64 (SGLang) or bytes (the low 64 bits,
big-endian); SGLang names the DP rank ``attn_dp_rank``.  Unknown trailing fields and
keys are ignored.  A payload that is not one of these is a :class:`BadEvent` (a
``SarpError``), raised before anything is applied.  This is the only module that
imports msgpack (pyzmq enters through :mod:`sarp.subscriber`, and through
:mod:`sarp.cluster` for the simulated engines).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np

from .errors import SarpError
from .hashing import as_hash, as_hashes

DEFAULT_MEDIUM = "GPU"


class BadEvent(SarpError, ValueError):
    """A payload that is not a KV event batch; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: np.ndarray
    parent: int | None
    medium: str = DEFAULT_MEDIUM
    lora_name: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: np.ndarray
    medium: str = DEFAULT_MEDIUM
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: list[Event] = field(default_factory=list)
    dp_rank: int | None = None


def decode(payload: bytes) -> Batch:
    """Decode one msgpack payload into a :class:`Batch`, or raise :class:`BadEvent`.

    >>> raw = msgpack.packb([1.5, [["BlockStored", [7, 8], None, [], 16, None, "GPU"]]])
    >>> decode(raw).events[0].block_hashes.tolist()
    [7, 8]
    """
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


def _batch(obj: object) -> Batch:
    if isinstance(obj, dict):
        ts, events = obj.get("ts"), obj.get("events")
        dp_rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
    elif isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        dp_rank = obj[2] if len(obj) > 2 else None
    else:
        raise BadEvent(f"a batch is a [ts, events, ...] array or a map, got {_show(obj)}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise BadEvent(f"batch ts must be a number, got {_show(ts)}")
    if not isinstance(events, list | tuple):
        raise BadEvent(f"batch events must be an array, got {_show(events)}")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool)
                                or dp_rank < 0):
        raise BadEvent(f"data_parallel_rank must be an int >= 0, got {_show(dp_rank)}")
    return Batch(float(ts), [_event(e) for e in events], dp_rank)


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _event(obj: object) -> Event:
    if isinstance(obj, dict):
        kind, fields = obj.get("type"), obj
    elif isinstance(obj, list | tuple) and obj:
        kind = obj[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(kind, ())
        fields = dict(zip(names, obj[1:], strict=False))
    else:
        raise BadEvent(f"an event is a tagged array or map, got {_show(obj)}")
    if kind == "AllBlocksCleared":
        return Cleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        raise BadEvent(f"unknown event type {_show(kind)}")
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list | tuple) or not hashes:
        raise BadEvent(f"{kind}.block_hashes must be a non-empty array, got {_show(hashes)}")
    block_hashes = as_hashes(hashes, name=f"{kind}.block_hashes")
    medium = fields.get("medium") or DEFAULT_MEDIUM
    group_idx = fields.get("group_idx")
    if not isinstance(medium, str):
        raise BadEvent(f"{kind}.medium must be a string, got {_show(medium)}")
    if group_idx is not None and (not isinstance(group_idx, int) or isinstance(group_idx, bool)):
        raise BadEvent(f"{kind}.group_idx must be an int, got {_show(group_idx)}")
    if kind == "BlockRemoved":
        return Removed(block_hashes, medium, group_idx)
    parent = fields.get("parent_block_hash")
    lora_name = fields.get("lora_name")
    if lora_name is not None and not isinstance(lora_name, str):
        raise BadEvent(f"BlockStored.lora_name must be a string, got {_show(lora_name)}")
    return Stored(
        block_hashes,
        None if parent is None else as_hash(parent, name="BlockStored.parent_block_hash"),
        medium,
        lora_name,
        group_idx,
    )


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def holder_name(source: str, dp_rank: int | None) -> str:
    """The holder a source's blocks are stored under: ``NAME``, or ``NAME#r`` per DP rank.

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
    seconds: float = 0.0  # time spent applying


def apply(index, source: str, batch: Batch, stats: ApplyStats | None = None) -> ApplyStats:
    """Apply a decoded batch from engine ``source`` to ``index``.

    ``BlockStored`` -> ``insert`` under holder ``source`` (``source#rank`` with a DP
    rank) and the event's medium; ``BlockRemoved`` -> ``remove``; ``AllBlocksCleared``
    -> ``clear`` of that holder in every medium.  A store whose parent is not held
    (its parent's store was lost) is skipped and counted, never guessed at.  Only
    KV cache group 0 (or events without a group) is applied; see ``skipped_groups``.

    Cost: one index write per event.
    """
    from .errors import ParentNotFoundError

    stats = stats or ApplyStats()
    started = time.perf_counter()
    holder = holder_name(source, batch.dp_rank)
    for event in batch.events:
        stats.events += 1
        if getattr(event, "group_idx", None) not in (None, 0):
            # Hybrid models report each KV cache group separately; a block counts as
            # cached when group 0 (full attention) has it, so other groups' events
            # could only make the index claim blocks group 0 does not hold.
            stats.skipped_groups += 1
            continue
        if isinstance(event, Stored):
            try:
                index.insert(event.block_hashes, parent=event.parent, holder=holder,
                             medium=event.medium)
                stats.blocks_stored += event.block_hashes.size
            except ParentNotFoundError:
                stats.skipped_orphans += 1
        elif isinstance(event, Removed):
            stats.blocks_removed += index.remove(event.block_hashes, holder=holder,
                                                 medium=event.medium)
        else:
            index.clear(holder)
            stats.clears += 1
    stats.batches += 1
    stats.seconds += time.perf_counter() - started
    return stats


def encode_batch(
    events: Sequence[tuple],
    *,
    ts: float = 0.0,
    dp_rank: int | None = None,
    keyed: bool = False,
) -> bytes:
    """Encode a batch the way vLLM does (for the simulated cluster and tests).

    ``events`` are ``("stored", hashes, parent, medium)``, ``("removed", hashes,
    medium)`` or ``("cleared",)``.  ``keyed`` picks the map encoding of newer vLLM.

    >>> decode(encode_batch([("cleared",)], keyed=True)).events
    [Cleared()]
    """
    out = []
    for e in events:
        if e[0] == "stored":
            hashes, parent, medium = [int(h) for h in e[1]], e[2], e[3]
            fields = [hashes, parent, [], 16, None, medium, None]
            names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                     "medium", "lora_name")
            out.append({"type": "BlockStored", **dict(zip(names, fields, strict=True))} if keyed
                       else ["BlockStored", *fields])
        elif e[0] == "removed":
            hashes, medium = [int(h) for h in e[1]], e[2]
            out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
                       if keyed else ["BlockRemoved", hashes, medium])
        else:
            out.append({"type": "AllBlocksCleared"} if keyed else ["AllBlocksCleared"])
    if keyed:
        batch: object = {"ts": ts, "events": out}
        if dp_rank is not None:
            batch["data_parallel_rank"] = dp_rank
    else:
        batch = [ts, out] + ([dp_rank] if dp_rank is not None else [])
    return msgpack.packb(batch)
