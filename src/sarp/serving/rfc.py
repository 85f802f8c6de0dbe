"""Mooncake RFC #1403's query API, answered as Dynamo's standalone indexer answers it
(``python -m dynamo.indexer``, ai-dynamo-runtime 1.6.1): ``POST /query`` with a
request's ``token_ids`` and ``POST /query_by_hash`` with the RFC's per-block hashes,
each naming its ``model_name`` (and ``routing_group``, or ``tenant_id``; default
``"default"``, plus ``lora_name`` for ``/query``).

Only engines registered with that model (and group) are in the answer: their blocks
are keyed by their tokens under the model's root (:mod:`sarp.tokenkeys`), so the
query's keys cannot reach another model's blocks.  The answer, per engine instance
and DP rank, in tokens (blocks times the model's block size)::

    {"scores": {"7": {"0": 32}},            # matched on GPU, per rank (only those > 0)
     "frequencies": [],
     "instances": {"7": {"longest_matched": 48, "gpu": 32, "dp": {"0": 32},
                         "cpu": 48, "disk": 48}}}

``cpu`` is the GPU prefix continued by the blocks the rank holds on CPU from there,
``disk`` that continued on disk (each the most over the instance's ranks), as Dynamo
reports its tiers; an instance none of whose tiers matched is left out.  A model (and
group) no engine is registered with gets 404, as from Dynamo.  This module parses and
answers; :mod:`sarp.serving.http` serves it.
"""

from __future__ import annotations

import array
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .. import native
from ..answer import presence_of
from ..hashing import as_hashes
from ..tokenkeys import DEFAULT_TENANT, SEED, chain_locals, model_root, token_keys
from .applier import holder_name
from .media import CPU, DISK, GPU

MAX_QUERY_BLOCKS = 1 << 18  # as /v1/match's MAX_REQUEST_BLOCKS
_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)  # array's uint32


class QueryError(ValueError):
    """A query refused: ``field`` names what is wrong, ``status`` is the HTTP status."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


@dataclass(slots=True)
class Model:
    """The engines registered with one model and group: their holders, block size."""

    name: str
    tenant: str
    block_size: int
    root: int
    ranks: dict[str, tuple[str, int]] = field(default_factory=dict)  # holder -> (iid, rank)


def models_of(engines: list[dict]) -> dict[tuple[str, str], Model]:
    """The models of the engines a status file lists (``asdict(Source)`` each).

    >>> m = models_of([{"name": "7", "dp_rank": 1, "model": "llama", "tenant": "default",
    ...                 "block_size": 16}])
    >>> m["llama", "default"].ranks
    {'7#1': ('7', 1)}
    """
    out: dict[tuple[str, str], Model] = {}
    for e in engines:
        if e.get("model") is None or not e.get("block_size"):
            continue
        tenant = e.get("tenant") or DEFAULT_TENANT
        model = out.get((e["model"], tenant))
        if model is None:
            model = out[e["model"], tenant] = Model(e["model"], tenant, int(e["block_size"]),
                                                    model_root(e["model"], tenant))
        rank = e.get("dp_rank") or 0
        model.ranks[holder_name(e["name"], rank)] = (e["name"], rank)
    return out


class Models:
    """:func:`models_of` the status file's engines, read again only when it changed.

    The file is looked at (a ``stat``) at most every ``check_every_s``, and at once
    when ``fresh``: a query for a model not in the table asks again before its 404,
    so a model registered a moment ago is never refused.  A table up to
    ``check_every_s`` old answers the rest, as a query that came that much earlier
    would have been answered; serve rewrites the file every 0.5 s (``STATUS_EVERY_S``),
    so 20 ms adds little to what a table can miss.  (Every millisecond was a ``stat``
    per 8 requests of a worker under wrk, about a quarter of its system calls after
    the read and the write.)

    Cost: a clock read per call; a ``stat`` every ``check_every_s``; a parse when the
    writer rewrote the file.
    """

    def __init__(self, read_status, status_dir, file_name: str,
                 check_every_s: float = 0.02) -> None:
        self._read, self._dir, self._path = read_status, status_dir, status_dir / file_name
        self._seen: tuple | None = None
        self._models: dict[tuple[str, str], Model] = {}
        self._check_every_s = check_every_s
        self._checked = -math.inf

    def get(self, fresh: bool = False) -> dict[tuple[str, str], Model]:
        now = time.monotonic()
        if not fresh and now - self._checked < self._check_every_s:
            return self._models
        self._checked = now
        try:
            st = os.stat(self._path)
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            seen = None
        if seen is None or seen != self._seen:
            status = self._read(self._dir) or {}
            self._models = models_of(status.get("engines", []))
            self._seen = seen
        return self._models


def parse_query(obj: object, by_hash: bool, models: dict[tuple[str, str], Model]
                ) -> tuple[Model, np.ndarray]:
    """The model a ``/query`` (or ``/query_by_hash``) body names and its blocks' keys.

    >>> ms = models_of([{"name": "7", "model": "m", "block_size": 4}])
    >>> model, keys = parse_query({"token_ids": list(range(9)), "model_name": "m"}, False, ms)
    >>> model.name, keys.size
    ('m', 2)
    """
    if not isinstance(obj, dict):
        raise QueryError("body", 'send a JSON object, e.g. {"token_ids": [1, 2, 3], '
                                 '"model_name": "llama"}')
    name = obj.get("model_name")
    if not isinstance(name, str):
        raise QueryError("model_name", f"model_name={name!r}; name the model the engines "
                                       "were registered with (POST /register model_name)")
    tenant = obj.get("routing_group", obj.get("tenant_id", DEFAULT_TENANT))
    if not isinstance(tenant, str):
        raise QueryError("routing_group", f"routing_group={tenant!r}; pass a string")
    model = _model(models, name, tenant)
    wanted = "block_hashes" if by_hash else "token_ids"
    values = obj.get(wanted)  # a list, or a uint64 array parsed in C (serving.http)
    if not isinstance(values, list | np.ndarray):
        raise QueryError(wanted, f"{wanted} must be an array of ints, got {type(values).__name__}")
    if by_hash:
        try:
            local = as_hashes(values, name="block_hashes", allow_empty=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise QueryError("block_hashes", str(exc)) from None
        if local.size > MAX_QUERY_BLOCKS:
            raise _too_many(local.size)
        return model, chain_locals(local, parent=model.root)
    tokens = _tokens(values)
    lora = obj.get("lora_name")
    if lora is not None and not isinstance(lora, str):
        raise QueryError("lora_name", f"lora_name={lora!r}; pass the adapter's name, or omit it")
    return model, _keys(model, tokens, lora)


def query_fields(body: bytes) -> tuple[np.ndarray, str, str | None, str | None] | None:
    """A ``/query`` body's token ids (uint32), ``model_name``, routing group
    (``routing_group``, else ``tenant_id``) and ``lora_name``, read in one C pass when
    the body has the shape routers send (``query_fields`` in ``rfc.c``: "token_ids"
    first, then those fields alone, their strings without escapes); None for any other
    body, or without the extension, and the general parse (orjson, then
    :func:`parse_query`, the reference) reads it.

    >>> f = query_fields(b'{"token_ids": [1, 2], "model_name": "m", "lora_name": null}')
    >>> f is None or (f[0].tolist(), f[1:]) == ([1, 2], ("m", None, None))
    True
    """
    c = native.C
    if c is None:
        native.ran_python("query_fields")
        return None
    got = c.query_fields(body)
    if got is None:
        return None
    return np.frombuffer(got[0], np.uint32), got[1], got[2], got[3]


def query_keys(fields: tuple[np.ndarray, str, str | None, str | None],
               models: dict[tuple[str, str], Model]) -> tuple[Model, np.ndarray]:
    """:func:`parse_query` of a ``/query`` whose fields were read and checked already
    (:func:`query_fields`, in C): ``(token ids as uint32, model_name,
    routing group or None, lora_name or None)``.

    >>> ms = models_of([{"name": "7", "model": "m", "block_size": 4}])
    >>> model, keys = query_keys((np.arange(9, dtype=np.uint32), "m", None, None), ms)
    >>> bool((keys == parse_query({"token_ids": list(range(9)), "model_name": "m"},
    ...                           False, ms)[1]).all())
    True
    """
    tokens, name, tenant, lora = fields
    model = _model(models, name, DEFAULT_TENANT if tenant is None else tenant)
    return model, _keys(model, tokens, lora)


def _model(models: dict[tuple[str, str], Model], name: str, tenant: str) -> Model:
    model = models.get((name, tenant))
    if model is None:
        raise QueryError("model_name", f"no indexer for model={name} routing_group={tenant}: "
                                       "no engine is registered with them (GET /workers)", 404)
    return model


def _keys(model: Model, tokens: np.ndarray, lora: str | None) -> np.ndarray:
    """A query's token keys under ``model``, refused past MAX_QUERY_BLOCKS blocks."""
    if tokens.size // model.block_size > MAX_QUERY_BLOCKS:
        raise _too_many(tokens.size // model.block_size)
    return token_keys(tokens, model.block_size, parent=model.root, lora_name=lora)[0]


def answer(match, model: Model) -> dict:
    """Dynamo's answer for a match (``index.match(keys, with_presence=True)``, or
    ``"rows"``).

    Cost: a few numpy calls per holder in the answer.
    """
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict] = {}
    size = model.block_size
    presence = match.presence if match.presence or match.holder_rows is None \
        else presence_of(match.holder_rows)  # (a match asked with_presence="rows")
    for holder, media in match.by_medium.items():
        who = model.ranks.get(holder)
        if who is None:
            continue  # not an engine of this model (another model cannot share a key)
        iid, rank = who
        g = media.get(GPU, 0)
        c = g + _run(presence.get((holder, CPU)), g)
        d = c + _run(presence.get((holder, DISK)), c)
        if d == 0:
            continue
        if g:
            scores.setdefault(iid, {})[str(rank)] = g * size
        inst = instances.setdefault(iid, {"longest_matched": 0, "gpu": 0, "dp": {},
                                          "cpu": 0, "disk": 0})
        inst["dp"][str(rank)] = g * size
        for tier, n in (("gpu", g), ("cpu", c), ("disk", d), ("longest_matched", d)):
            inst[tier] = max(inst[tier], n * size)
    return {"scores": scores, "frequencies": [], "instances": instances}


EMPTY = {"scores": {}, "frequencies": [], "instances": {}}


def reading_of(reading) -> tuple | None:
    """What :func:`answer_now` reads of an index (``Index.reading()``) on LMDB: the lock
    that guards its memory (a reader's lock; a writer's memory lock, held only while a
    commit's changes go into memory, so that serve's ``/query`` on a thread beside its
    writer waits for no write); its environment's ``begin`` and the keyword arguments
    naming the segments' and the meta tables, as ``LmdbReadTxn`` reads them; the store,
    memory and match observers; and what C reads those tables with in read
    transactions of its own, ``LmdbStore.raw_reads``, or None: then through ``begin``.
    None for any other (Valkey): the general path's.  C answers only when the memory is
    current with its read (the log's counter is the memory's watermark), for a writer
    as for a reader.
    """
    store = reading.store
    env = getattr(store, "env", None)  # (an LmdbStore's)
    if store.capabilities.prefetch or env is None:
        return None
    return (reading.memory.lock, env.begin, {"db": store.segments_db}, {"db": store.meta_db},
            store, reading.memory, reading.observers, store.raw_reads())


def answer_now(body: bytes, models: dict[tuple[str, str], Model],
               reading: tuple | None) -> bytes | None:
    """A ``/query``'s answer in one C call (``rfc_query`` in ``rfc.c``): the body read,
    the model found, the token keys, the match on a readonly LMDB index (``reading``:
    :func:`reading_of`) and the answer from its rows; byte for byte what the general
    path gives (:func:`query_fields`, :func:`query_keys`, ``Index.match(keys,
    with_presence="rows")``, :func:`answer_c`).  None whenever C leaves it to that
    path: another body shape, a LoRA adapter, a model not in ``models``, no full
    block, the index's lock held or its memory behind the store (a writer committed
    since: the Python path catches up), a walk C hands back, a damaged record, any
    error; or without the extension.  Not counted in the index's match counters.

    Cost: the C parts of the general path, with none of its Python between them.
    """
    c = native.C
    if c is None or reading is None:
        native.ran_python("rfc_query")
        return None
    got = c.rfc_query(body, models, DEFAULT_TENANT, SEED, MAX_QUERY_BLOCKS, reading)
    if got is None:
        native.ran_python("rfc_query")
    return got


def answer_c(match, model: Model) -> bytes | None:
    """:func:`answer` as JSON, made in one C call (``serving/rfc.c``) from the match's
    rows (``match(..., with_presence=True)``: see :class:`sarp.answer.HolderRows`): byte
    for byte what ``orjson.dumps(answer(match, model))`` gives.  None when C cannot (no
    extension, a match without rows, more holders than C scans): the caller encodes
    :func:`answer`'s dict then (``serving.http``, orjson's one door).

    Cost: a scan of each holder's row and a few operations per holder, in C.

    >>> import json
    >>> from sarp.answer import HolderRows, Match
    >>> ms = models_of([{"name": "7", "model": "m", "block_size": 4}])
    >>> names = {0: ("7#0", GPU), 1: ("7#0", CPU)}
    >>> m = Match(3, {"7#0": 3}, {"7#0": {GPU: 1, CPU: 3}}, {}, 1,
    ...           {("7#0", GPU): np.array([1, 0, 0], bool), ("7#0", CPU): np.ones(3, bool)},
    ...           True, HolderRows({0: b"\\x01\\x00\\x00", 1: b"\\x01\\x01\\x01"}, names))
    >>> got = answer_c(m, ms["m", DEFAULT_TENANT])
    >>> got is None or json.loads(got) == answer(m, ms["m", DEFAULT_TENANT])
    True
    """
    c = native.C
    got = None if c is None or match.holder_rows is None else c.rfc_answer(
        *match.holder_rows, model.ranks, model.block_size)
    if got is None:
        native.ran_python("rfc_answer")
    return got


def _run(presence: np.ndarray | None, start: int) -> int:
    """How many blocks from ``start`` on the holder has, one after another."""
    if presence is None or start >= presence.size:
        return 0
    row = presence.tobytes()  # one byte per block: bytes.find, no numpy call per holder
    gap = row.find(0, start)
    return (len(row) if gap < 0 else gap) - start


def _tokens(values: list | np.ndarray) -> np.ndarray:
    """Token ids as uint32, converted in C (``array.array`` refuses floats, strings,
    None and ints out of range; only bools slip through, so the few items <= 1 are
    checked by type); anything else is named item by item.  An array is taken as the
    caller parsed it (in range)."""
    if isinstance(values, np.ndarray):
        return values.astype(np.uint32, copy=False)
    try:
        arr = np.frombuffer(array.array(_U32, values), np.uint32)
    except (TypeError, OverflowError):
        pass
    else:
        small = np.flatnonzero(arr <= 1)
        if not any(type(values[i]) is bool for i in small.tolist()):
            return arr
    for i, v in enumerate(values):
        if type(v) is not int or not 0 <= v <= 0xFFFFFFFF:
            raise QueryError(f"token_ids[{i}]", f"token_ids[{i}] must be an int from 0 to "
                                                f"2**32 - 1, got {v!r}")
    raise QueryError("token_ids", "token_ids must be ints from 0 to 2**32 - 1")


def _too_many(blocks: int) -> QueryError:
    return QueryError("token_ids", f"the query has {blocks} blocks; one may ask for at most "
                                   f"{MAX_QUERY_BLOCKS}", 413)
