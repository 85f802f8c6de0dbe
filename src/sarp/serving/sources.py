"""The engines serve follows: one :class:`Source` per engine endpoint (and DP rank),
what serve remembers of each (:class:`Fingerprint`, the last batch applied), what it
counts (:class:`SourceStats`), and what one replay may take (:class:`ReplayBudget`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .applier import ApplyStats, holder_name


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
    expanded per rank, else the rank each batch carries.
    """

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    dp_rank: int | None = None

    @property
    def key(self) -> str:
        """The source's name in stats and state: ``NAME``, or ``NAME#r`` per rank."""
        return holder_name(self.name, self.dp_rank)

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
