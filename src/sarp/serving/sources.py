"""The engines serve follows: one :class:`Source` per engine endpoint (and DP rank),
what serve remembers of each (:class:`Fingerprint`, the last batch applied), what it
counts (:class:`SourceStats`), and what one replay may take (:class:`ReplayBudget`).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ..tokenkeys import DEFAULT_TENANT, model_root
from .applier import ApplyStats, holder_name

log = logging.getLogger("sarp.subscriber")
STATE_FILE = "subscriber.json"
STATE_VERSION = 2


@dataclass(frozen=True, slots=True)
class ReplayBudget:
    """What one replay attempt may take: wall time, frames and bytes received.

    A replay over budget (an endpoint that trickles garbage or never ends) is
    stopped, the source's holders are cleared, and the replay is tried again after a
    backoff.  The defaults leave room for an engine's whole buffer: vLLM keeps
    10,000 batches, and a subscriber takes about 50,000 a second.
    """

    seconds: float = 60.0
    frames: int = 2_000_000
    bytes: int = 4 << 30


@dataclass(frozen=True, slots=True)
class Source:
    """An engine publisher to follow: the engine's name, its endpoints, its DP rank.

    Blocks are held by ``NAME#r``: ``r`` is ``dp_rank`` when the source was
    expanded per rank, else the rank each batch carries.  An engine registered with
    a ``model`` (``/register``, or ``model:`` in the sources file) has its blocks keyed
    by their tokens under the model's and tenant's root (:mod:`sarp.tokenkeys`), and
    ``block_size`` is the model's (what ``/query`` hashes tokens with); without one,
    its blocks are keyed by the engine's own hashes, as ``--source`` engines are.
    """

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    dp_rank: int | None = None
    model: str | None = None
    tenant: str = DEFAULT_TENANT
    block_size: int | None = None

    @property
    def key(self) -> str:
        """The source's name in stats and state: ``NAME``, or ``NAME#r`` per rank."""
        return holder_name(self.name, self.dp_rank)

    @property
    def root(self) -> int | None:
        """The root its blocks' token keys chain from; None when keyed by engine hashes.

        >>> Source("e", "tcp://127.0.0.1:5557").root is None
        True
        """
        return None if self.model is None else model_root(self.model, self.tenant)

    @classmethod
    def parse(cls, spec: str) -> Source:
        """``NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT]``.

        >>> Source.parse("w0=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558").replay_endpoint
        'tcp://127.0.0.1:5558'
        """
        name, sep, rest = spec.partition("=")
        endpoints = [e for e in rest.split(",") if e]
        if not sep or not name or not 1 <= len(endpoints) <= 2 or "#" in name:
            raise ValueError(
                f"source {spec!r}: write NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT], e.g. "
                "w0=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 (no '#' in NAME)"
            )
        for endpoint in endpoints:
            check_endpoint(endpoint, spec)
        return cls(name, endpoints[0], endpoints[1] if len(endpoints) == 2 else None)

    @classmethod
    def expand(cls, spec: str, dp_ranks: int | None = None) -> list[Source]:
        """One source per DP rank, on the ports the engines bind: base port + rank.

        vLLM and SGLang offset both endpoints' tcp port by the rank (``inproc``
        endpoints get a ``_dp{r}`` suffix).  ``dp_ranks=None`` gives the single
        source ``spec`` names.

        >>> [s.endpoint for s in Source.expand("e=tcp://10.0.0.5:5557", dp_ranks=2)]
        ['tcp://10.0.0.5:5557', 'tcp://10.0.0.5:5558']
        >>> Source.expand("e=tcp://10.0.0.5:5557", dp_ranks=2)[1].key
        'e#1'
        """
        base = cls.parse(spec)
        if dp_ranks is None:
            return [base]
        if isinstance(dp_ranks, bool) or not isinstance(dp_ranks, int) or dp_ranks < 1:
            raise ValueError(f"dp_ranks={dp_ranks!r}; pass the engine's DP size, an int >= 1")
        return [cls(base.name, rank_endpoint(base.endpoint, r),
                    None if base.replay_endpoint is None
                    else rank_endpoint(base.replay_endpoint, r), r)
                for r in range(dp_ranks)]


def check_endpoint(endpoint: str, spec: str) -> None:
    """ValueError naming the fix unless ``endpoint`` is a ZeroMQ endpoint an engine
    binds: ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``.

    >>> check_endpoint("127.0.0.1:5557", "e=127.0.0.1:5557")
    Traceback (most recent call last):
    ...
    ValueError: source 'e=127.0.0.1:5557': endpoint '127.0.0.1:5557' has no transport; write tcp://127.0.0.1:5557
    """
    transport, sep, where = endpoint.partition("://")
    if not sep:
        raise ValueError(f"source {spec!r}: endpoint {endpoint!r} has no transport; write "
                         f"tcp://{endpoint}")
    if transport not in ("tcp", "ipc", "inproc") or not where:
        raise ValueError(f"source {spec!r}: endpoint {endpoint!r}: pass tcp://HOST:PORT, "
                         "ipc://PATH or inproc://NAME")
    host, colon, port = where.rpartition(":")
    if transport == "tcp" and (not colon or not host or not port.isdigit()
                               or not 0 < int(port) < 65536):
        raise ValueError(f"source {spec!r}: endpoint {endpoint!r} needs a port from 1 to "
                         "65535, e.g. tcp://127.0.0.1:5557")


def rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint DP rank ``dp_rank`` of an engine binds, given rank 0's.

    >>> rank_endpoint("tcp://127.0.0.1:5557", 3), rank_endpoint("inproc://kv", 1)
    ('tcp://127.0.0.1:5560', 'inproc://kv_dp1')
    """
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    head, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit() and int(port) > 0:
        return f"{head}:{int(port) + dp_rank}"
    raise ValueError(
        f"endpoint {endpoint!r}: engines offset a tcp port (or an inproc name) per DP rank; "
        "for other endpoints pass one --source per rank"
    )


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What identifies the last applied batch of a source."""

    seq: int
    digest: int | None  # xxh3-64 of the payload; None when unknown (an old state file)
    ts: float
    # The digest of batch seq - 1, when it was applied just before: a proof checks
    # both, so one new-engine batch taken as a continuation before a reconnect was
    # noticed cannot prove itself.
    prev_digest: int | None = None


@dataclass(slots=True)
class SourceStats:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replayed: int = 0
    unrecoverable_gaps: int = 0
    restarts: int = 0
    continuity_checks: int = 0
    bad_payloads: int = 0
    bad_frames: int = 0
    rank_mismatches: int = 0
    probes: int = 0  # liveness probes sent after a silence
    disconnects: int = 0  # live connections dropped (engine gone, or a frame too large)
    failed_replays: int = 0  # replays over budget or without their end (cleared, retried)
    gone: int = 0  # times a probe went unanswered and the holders were cleared
    hash_checks: int = 0  # stores whose hashes were checked against their tokens
    hash_mismatches: int = 0  # ... and did not follow from them as serve hashes tokens
    hash_note: str = ""  # the scheme and seed that would, when one of the known ones does
    applied: ApplyStats = field(default_factory=ApplyStats)


def load_fingerprints(index) -> dict[str, Fingerprint]:
    """What ``subscriber.json`` (kept with the index) says was applied of each source;
    {} when there is none, or it cannot be read (logged: the engines are asked again)."""
    try:
        raw = index.read_state(STATE_FILE)
        if raw is None:
            return {}
        state = json.loads(raw)
        if "last_seq" in state:  # version 1: sequences only, continuity unprovable
            return {str(k): Fingerprint(int(v), None, 0.0) for k, v in state["last_seq"].items()}
        return {str(k): Fingerprint(int(v["seq"]), v["digest"], float(v["ts"]),
                                    v.get("prev_digest"))
                for k, v in state["sources"].items()}
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("sarp: ignoring unreadable %s of %s (%s); starting fresh", STATE_FILE,
                    index.path, exc)
        return {}


def fingerprints_state(committed: dict[str, Fingerprint]) -> dict[str, bytes]:
    """``subscriber.json``'s named value for ``committed``, as :meth:`sarp.Index.apply_decoded`
    and :meth:`sarp.Index.write_state` take it.

    Cost: one JSON dump (a commit carries it: not ``dataclasses.asdict``, whose copy of
    each field was 141 µs a commit for 8 engines, 36 µs now).

    >>> fingerprints_state({"e#0": Fingerprint(7, 9, 1.5)})[STATE_FILE]
    b'{"version": 2, "sources": {"e#0": {"seq": 7, "digest": 9, "ts": 1.5, "prev_digest": null}}}'
    """
    data = json.dumps({"version": STATE_VERSION,
                       "sources": {k: {"seq": fp.seq, "digest": fp.digest, "ts": fp.ts,
                                       "prev_digest": fp.prev_digest}
                                   for k, fp in committed.items()}})
    return {STATE_FILE: data.encode()}


class FingerprintFile:
    """``subscriber.json``, written in the transaction of the commit it describes
    (:meth:`state` hands the subscriber's flush what to pass the applier), or by
    :meth:`save` in a write of its own when no commit took it; a state whose write
    failed is held, and written at the next :meth:`save` or :meth:`due`.

    In the commit's own transaction, never apart: a state that trails the index has a
    restart apply the batches after it again on top of a later state, where a store
    whose parent a later batch removed is refused, and the index lost blocks the
    engines held (tests/test_cluster.py's kill -9: 1 run of 22 under load, when the
    file was written after each commit).

    Cost: a JSON dump per commit, carried by it (one more LMDB put, or a ``SET`` in
    the batch's ``MULTI``); :meth:`save`, one write transaction (a fenced ``SET``).

    >>> import tempfile, sarp
    >>> with sarp.open(tempfile.mkdtemp()) as index:
    ...     state = FingerprintFile(index)
    ...     _ = index.apply_decoded([], state=state.state({"e#0": Fingerprint(7, None, 0.0)}))
    ...     state.save({"e#1": Fingerprint(8, None, 0.0)})
    ...     state.due()  # nothing held
    ...     sorted(load_fingerprints(index))
    ['e#1']
    """

    def __init__(self, index) -> None:
        self.index = index
        self._held: dict[str, Fingerprint] | None = None

    def state(self, committed: dict[str, Fingerprint]) -> dict[str, bytes]:
        """What a commit carries to have written ``committed``; a held one is then moot
        (the caller :meth:`save`s when no commit took it)."""
        self._held = None
        return fingerprints_state(committed)

    def save(self, committed: dict[str, Fingerprint], *, durable: bool = False) -> None:
        """Write ``committed`` in a write of its own (fsync'ed when ``durable``)."""
        self._held = committed
        self._write(durable)

    def due(self) -> None:
        """Write a state whose write failed, if any."""
        if self._held is not None:
            self._write(False)

    def _write(self, durable: bool) -> None:
        data = fingerprints_state(self._held)[STATE_FILE]
        self.index.write_state(STATE_FILE, data, durable=durable)  # a StoreError keeps it held
        self._held = None


def plain(obj) -> dict:
    """A dataclass's fields, nested dataclasses and counters as plain dicts (JSON-ready).

    Not ``dataclasses.asdict``: it rebuilds a ``Counter`` from ``(key, value)`` pairs,
    which counts the pairs, and ``json.dumps`` then refuses the tuple keys (a single
    bad event stopped ``serve --http``; tests/test_hardening.py).
    """
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Counter):
            value = {str(k): int(v) for k, v in value.items()}
        elif hasattr(value, "__dataclass_fields__"):
            value = plain(value)
        out[f.name] = value
    return out


SOURCES_STATE = "sources.json"  # the engines a serve follows, kept with the index


def read_sources_file(path, dp_ranks: int | None = None) -> list[Source]:
    """The engines a sources file names, in YAML or JSON (a Kubernetes ConfigMap's key,
    mounted as a file): a list, or a mapping whose ``engines`` is one, of
    ``NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT]`` strings (as ``--source`` takes) or mappings
    with ``name``, ``endpoint``, and optionally ``replay_endpoint``, ``dp_ranks``
    (default ``dp_ranks``, as ``--dp-ranks``) and ``model_name`` with ``block_size``
    (and ``routing_group``): blocks keyed by their tokens, for ``/query``.  A
    ValueError names the file and the entry.  Cost: one read and parse of the file.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "engines.yaml"
    >>> _ = f.write_text("engines:\\n  - name: w0\\n    endpoint: tcp://10.0.0.5:5557\\n"
    ...                  "    dp_ranks: 2\\n  - w1=tcp://10.0.0.6:5557,tcp://10.0.0.6:5558\\n")
    >>> [s.key for s in read_sources_file(f)]
    ['w0#0', 'w0#1', 'w1']
    """
    import yaml  # the sources file's format: this module is pyyaml's one door

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--sources-file {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--sources-file {path}: not YAML or JSON ({exc})") from None
    entries = doc.get("engines") if isinstance(doc, dict) else doc
    if not isinstance(entries, list):
        raise ValueError(f"--sources-file {path}: write a list of engines, or a mapping with "
                         "'engines:' holding one (each NAME=PUB[,REPLAY], or a mapping with "
                         "name and endpoint)")
    out: list[Source] = []
    for i, entry in enumerate(entries):
        keyed: dict = {}
        if isinstance(entry, str):
            spec, ranks = entry, dp_ranks
        elif isinstance(entry, dict) and isinstance(entry.get("name"), str) \
                and isinstance(entry.get("endpoint"), str):
            replay = entry.get("replay_endpoint")
            spec = f"{entry['name']}={entry['endpoint']}" + (f",{replay}" if replay else "")
            ranks = entry.get("dp_ranks", dp_ranks)
            keyed = _model_of(entry, f"--sources-file {path}: engine {i}")
        else:
            raise ValueError(f"--sources-file {path}: engine {i} is {entry!r}; write "
                             "NAME=PUB[,REPLAY] or a mapping with name and endpoint")
        try:
            out += [replace(s, **keyed) for s in Source.expand(spec, ranks)]
        except ValueError as exc:
            raise ValueError(f"--sources-file {path}: engine {i}: {exc}") from None
    keys = [s.key for s in out]
    if len(set(keys)) != len(keys):
        raise ValueError(f"--sources-file {path}: an engine is named twice ({keys})")
    return out


def _model_of(entry: dict, where: str) -> dict:
    """A sources-file mapping's model fields, as :class:`Source`'s (none: engine keys)."""
    model = entry.get("model_name", entry.get("model"))
    if model is None:
        return {}
    tenant = entry.get("routing_group", entry.get("tenant_id", DEFAULT_TENANT))
    size = entry.get("block_size")
    if not isinstance(model, str) or not model or not isinstance(tenant, str):
        raise ValueError(f"{where}: model_name and routing_group are names (strings)")
    if type(size) is not int or not 0 < size <= 0xFFFF:
        raise ValueError(f"{where}: block_size={size!r}; with a model_name, give the "
                         "engine's block size (tokens per block, 1 to 65535)")
    return {"model": model, "tenant": tenant, "block_size": size}


def load_sources(index) -> list[tuple[Source, bool]]:
    """The engines the last serve of this index followed, each with whether it came
    by ``/register`` (rather than ``--source`` or the sources file); [] when none."""
    raw = index.read_state(SOURCES_STATE)
    if raw is None:
        return []
    try:
        return [(Source(str(s["name"]), str(s["endpoint"]), s.get("replay_endpoint"),
                        s.get("dp_rank"), s.get("model"), s.get("tenant", DEFAULT_TENANT),
                        s.get("block_size")), bool(s.get("registered")))
                for s in json.loads(raw)["sources"]]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("sarp: ignoring unreadable %s of %s (%s)", SOURCES_STATE, index.path, exc)
        return []


def save_sources(index, sources: list[Source], registered: set[str]) -> None:
    """Keep the engines followed with the index (``registered``: the keys of those that
    came by ``/register``), so that a restarted serve follows them."""
    index.write_state(SOURCES_STATE, json.dumps({"sources": [
        {**asdict(s), "registered": s.key in registered} for s in sources]}).encode(),
        durable=True)
