"""Serving-engine KV cache events, as they are on the wire: decoding (applying them is
:mod:`sarp.serving.applier`'s).

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
:func:`sarp.serving.applier.apply` counts it and applies the rest.  This is the only
module that imports msgpack (pyzmq enters through :mod:`sarp.serving.subscriber` and
its replays, and through :mod:`sarp.bench.cluster` for the simulated engines).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np

from .. import native
from ..errors import (
    SarpError,
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
    # the tokens (uint32) and the tokens per block, when the engine sent them as ints
    # that fit (what token keys are made of: sarp.tokenkeys)
    token_ids: np.ndarray | None = field(default=None, compare=False)
    block_size: int | None = field(default=None, compare=False)


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


def decode(payload: bytes, tokens: bool = False) -> Batch:
    """Decode one msgpack payload into a :class:`Batch`, or raise :class:`BadEvent`.

    Only a batch that cannot be read raises; a bad event inside a readable batch
    becomes a :class:`Malformed` in ``events``.  ``tokens``: hand each store's token
    ids and block size on (engines keyed by their tokens need them; reading them
    costs about as much as the rest of the decode, so others do without).

    >>> raw = msgpack.packb([1.5, [["BlockStored", [7, 8], None, [], 16, None, "GPU"]]])
    >>> decode(raw).events[0].block_hashes.tolist()
    [7, 8]
    >>> decode(msgpack.packb([1.5, [{"type": "BlockStored", "block_hashes": [7, 7],
    ...     "parent_block_hash": None}]])).events[0].kind
    'repeated_hash'
    """
    c = native.C
    if c is not None:
        batch = _from_native(c.decode_batch(payload, tokens))
        if batch is not None:
            return batch
    else:
        native.ran_python("decode_batch")
    batch = _decode_common(payload)
    batch = batch if batch is not None else _decode_full(payload)
    if not tokens:
        for e in batch.events:
            if type(e) is Stored:
                e.token_ids = e.block_size = None
    return batch


_MEDIA: dict[str, str | None] = {}  # a medium as sent -> canonical, or None if invalid
_MEDIA_CACHED = 1024  # engines send a handful; a stream of odd names is not cached


def tier_of(medium: str | None) -> str | None:
    """The tier an engine's medium name maps to (none: ``DEFAULT_MEDIUM``), or None
    for a name sarp refuses.  Cost: a dict lookup for a name seen before.

    >>> tier_of(None), tier_of("cpu_pinned"), tier_of("GPU\\x00")
    ('GPU', 'CPU', None)
    """
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
            medium = tier_of(e[3])
            if medium is None:
                return None
            tokens = None if e[6] is None else np.frombuffer(e[6], np.uint32)
            events.append(Stored(np.frombuffer(e[1], np.uint64), e[2], medium, e[4], e[5],
                                 tokens, e[7]))
        elif e[0] == "BlockRemoved":
            medium = tier_of(e[2])
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


# Fields of a store that sarp never reads: the streaming decode reads past them without
# building them.  Token ids (most of a store's bytes) and extra keys are read on their
# own (_read_tokens), so that text in them that is not UTF-8 does not sink the batch.
_SKIPPED: frozenset = frozenset()
_READ_APART = frozenset({"token_ids", "extra_keys"})
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
            elif name in _READ_APART:
                fields[name] = _read_tokens(unpacker, payload)
            else:
                fields[name] = unpacker.unpack()
    elif head in _MAP_TYPES:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in _SKIPPED:
                unpacker.skip()
            elif key in _READ_APART:
                fields[key] = _read_tokens(unpacker, payload)
            else:
                fields[key] = unpacker.unpack()
        kind = fields.get("type")
    else:
        return None
    return _checked_event(kind, fields)


_UNREADABLE = object()  # token ids or extra keys whose text is not UTF-8


def _read_tokens(unpacker: msgpack.Unpacker, payload: bytes) -> object:
    """The value at the unpacker's position (token ids, extra keys), or
    ``_UNREADABLE``; read past either way."""
    start = unpacker.tell()
    unpacker.skip()
    try:
        return msgpack.unpackb(payload[start:unpacker.tell()], raw=False)
    except Exception:  # msgpack raises several unrelated types on bad input
        return _UNREADABLE


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
    tokens, block_size = _tokens(fields.get("token_ids"), fields.get("block_size"))
    if _has_extras(fields.get("extra_keys"), lora_name):
        tokens, block_size = None, None  # its tokens alone do not name its blocks
    return Stored(block_hashes, parent_hash, medium, lora_name, group_idx, tokens, block_size)


def _has_extras(extra_keys: object, lora_name: str | None) -> bool:
    """Do a store's extra keys hold more than its LoRA name (multimodal inputs, a cache
    salt, prompt embeddings)?  Then its blocks cannot be keyed by their tokens."""
    if extra_keys is None:
        return False
    if not isinstance(extra_keys, list | tuple):
        return True
    return any(entry is not None and not (isinstance(entry, list | tuple) and len(entry) == 1
                                          and lora_name is not None and entry[0] == lora_name)
               for entry in extra_keys)


def _tokens(tokens: object, block_size: object) -> tuple[np.ndarray | None, int | None]:
    """A store's token ids as uint32 and its block size, or ``(None, None)`` when they
    are absent or not ints that fit (the store is then keyed through its hashes)."""
    if (type(block_size) is not int or not 0 < block_size <= 0xFFFF
            or not isinstance(tokens, list | tuple)
            or not set(map(type, tokens)) <= {int}):  # numpy would take 2.5 as 2
        return None, None
    try:
        arr = np.array(tokens, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return None, None
    if arr.ndim != 1 or (arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF)):
        return None, None
    out = arr.astype(np.uint32)
    out.flags.writeable = False  # as the C decoder's, a view of bytes
    return out, block_size


def root_stores(payload: bytes, limit: int = 4) -> list[tuple[np.ndarray, list[int], int]]:
    """Up to ``limit`` stores of a payload that start a chain and carry what their hashes
    were made from, as ``(block_hashes, token_ids, block_size)``: no parent, token ids
    for every block, a block size, no LoRA, no extra keys, KV group 0 (the engine's
    hash of such a store follows from its tokens, the scheme and the seed alone).  For
    serve's check of the engines' hash scheme (:mod:`sarp.serving.hashcheck`); [] for
    anything else.

    Cost: a whole msgpack decode of the payload, token ids included: serve runs it on
    an engine's first batches, not on every one.

    >>> stores = root_stores(encode_batch([("stored", [7, 8], None, "GPU")], ts=1.0))
    >>> stores[0][0].tolist(), len(stores[0][1]), stores[0][2]
    ([7, 8], 32, 16)
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - msgpack raises many kinds; any is "not a batch"
        return []
    events = obj.get("events") if isinstance(obj, dict) else (
        obj[1] if isinstance(obj, list) and len(obj) >= 2 else None)
    out: list[tuple[np.ndarray, list[int], int]] = []
    for e in events if isinstance(events, list) else ():
        if isinstance(e, dict):
            kind, fields = e.get("type"), e
        elif isinstance(e, list) and e:
            kind, fields = e[0], dict(zip(_STORED_FIELDS, e[1:], strict=False))
        else:
            continue
        tokens, size = fields.get("token_ids"), fields.get("block_size")
        hashes = fields.get("block_hashes")
        if (kind != "BlockStored" or fields.get("parent_block_hash") is not None
                or fields.get("lora_id") is not None or fields.get("lora_name") is not None
                or fields.get("extra_keys") or fields.get("group_idx") not in (None, 0)
                or type(size) is not int or size <= 0 or not isinstance(tokens, list)
                or not isinstance(hashes, list) or not hashes
                or len(tokens) != size * len(hashes)
                or not all(type(t) is int and t >= 0 for t in tokens)):
            continue
        try:
            out.append((as_hashes(hashes), tokens, size))
        except (TypeError, ValueError, OverflowError):
            continue
        if len(out) >= limit:
            break
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def encode_batch(
    events: Sequence[tuple],
    *,
    ts: float = 0.0,
    dp_rank: int | None = None,
    style: str = "vllm-0.11",
    token_ids: Sequence[list[int] | None] | None = None,
) -> bytes:
    """Encode a batch exactly as an engine does (for the simulated cluster and tests).

    ``events`` are ``("stored", hashes, parent, medium)``, ``("removed", hashes,
    medium)`` or ``("cleared",)`` (a stored or removed tuple may end with a
    ``group_idx``).  ``style`` picks the engine's encoding: ``"vllm-0.11"``
    (positional batch, tagged-array events: vLLM 0.9 to 0.11), ``"vllm-0.33"``
    (positional batch, tagged-map events with default fields omitted: vLLM 0.12
    on) or ``"sglang"`` (positional batch with ``attn_dp_rank`` always present,
    tagged maps, hashes as signed int64).  ``token_ids``: per event, the tokens a
    store carries (``BLOCK_SIZE`` per block), or None for ids made up from its hashes
    (the simulated engines' hashes do not follow from their tokens).

    >>> decode(encode_batch([("cleared",)], style="sglang")).events
    [Cleared()]
    """
    if style not in ENCODING_STYLES:
        raise ValueError(f"style={style!r}; pick one of {ENCODING_STYLES}")
    tokens = token_ids if token_ids is not None else [None] * len(events)
    out = [_encode_event(e, style, t) for e, t in zip(events, tokens, strict=True)]
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


def _encode_event(e: tuple, style: str, token_ids: list[int] | None = None) -> object:
    def ints(hashes) -> list[int]:
        values = [int(h) for h in hashes]
        return [v - 2**64 if v >= 2**63 else v for v in values] if style == "sglang" else values

    if e[0] == "cleared":
        return {"type": "AllBlocksCleared"} if style != "vllm-0.11" else ["AllBlocksCleared"]
    if e[0] == "stored":
        parent = None if e[2] is None else ints([e[2]])[0]
        group = e[4] if len(e) > 4 else None
        tokens = _tokens_of(e[1]) if token_ids is None else list(token_ids)
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
