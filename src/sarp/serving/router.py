"""The router's question: which engine instance holds the longest prefix, on which tier.

:func:`score` answers it from one verified ``match``: per instance (an engine, or
one DP rank of it: holder ``NAME#r``), the blocks of its longest prefix, how many
of them are best served from each medium, tokens, and a tier-weighted score (each
block counts the weight of the best medium it is held in).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from ..answer import Match
from ..hashing import HashesLike, hash_blocks
from .media import canonical_medium

log = logging.getLogger("sarp.router")

DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType({"GPU": 1.0, "CPU": 0.8,
                                                               "DISK": 0.5})
UNKNOWN_TIER_WEIGHT = 0.3
_warned_unknown: set[str] = set()
_default_scorers: dict[int | None, _Scorer] = {}  # by block_size, for the default weights


@dataclass(frozen=True, slots=True)
class InstanceScore:
    """One instance's share of a request's prefix."""

    instance: str
    engine: str
    dp_rank: int | None
    matched_blocks: int
    matched_tokens: int | None
    by_medium: dict[str, int] = field(default_factory=dict)  # blocks by best medium
    score: float = 0.0  # tier-weighted blocks


def score(
    index,
    hashes: HashesLike | None = None,
    *,
    token_ids: Sequence[int] | np.ndarray | None = None,
    block_size: int | None = None,
    weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
    unknown_weight: float = UNKNOWN_TIER_WEIGHT,
    scheme: str = "xxh3",
    seed: str | None = None,
) -> list[InstanceScore]:
    """Per-instance prefix scores for one request, best first.

    Pass block ``hashes``, or ``token_ids`` and ``block_size``, hashed with
    :func:`sarp.hash_blocks` in the engines' ``scheme`` (``"vllm-sha256"``, vLLM's
    default, and its other three with their ``seed``, ``"sglang"``, or sarp's ``"xxh3"``).
    ``weights`` maps a medium to its weight; engines' aliases count as their
    canonical tier on both sides (``CPU_PINNED`` and ``cpu`` are ``CPU``,
    ``STORAGE`` is ``DISK``: :mod:`sarp.serving.media`), and a medium ``weights`` does not
    name weighs ``unknown_weight`` (logged once per medium).  Tokens are reported
    when ``block_size`` is given.

    Cost: one ``match`` plus numpy work over the matched blocks.

    >>> import tempfile, sarp
    >>> with sarp.open(tempfile.mkdtemp()) as index:
    ...     _ = index.insert([1, 2, 3, 4], holder="w0", medium="CPU")
    ...     _ = index.insert([1, 2], holder="w1#0", medium="GPU")
    ...     [(s.instance, s.matched_blocks, s.score) for s in score(index, [1, 2, 3, 4])]
    [('w0', 4, 3.2), ('w1#0', 2, 2.0)]
    """
    return score_match(index, hashes, token_ids=token_ids, block_size=block_size,
                       weights=weights, unknown_weight=unknown_weight, scheme=scheme,
                       seed=seed)[1]


def score_match(
    index,
    hashes: HashesLike | None = None,
    *,
    token_ids: Sequence[int] | np.ndarray | None = None,
    block_size: int | None = None,
    weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
    unknown_weight: float = UNKNOWN_TIER_WEIGHT,
    scheme: str = "xxh3",
    seed: str | None = None,
) -> tuple[Match, list[InstanceScore]]:
    """:func:`score`, and the ``Match`` it was computed from (for ``num_blocks``).

    Cost: as :func:`score`.

    >>> import tempfile, sarp
    >>> with sarp.open(tempfile.mkdtemp()) as index:
    ...     _ = index.insert([1, 2, 3], holder="w0")
    ...     m, scores = score_match(index, [1, 2, 3, 4])
    ...     m.num_blocks, [s.instance for s in scores]
    (3, ['w0'])
    """
    if hashes is None:
        if token_ids is None or block_size is None:
            raise ValueError("pass hashes, or token_ids together with block_size")
        hashes = hash_blocks(token_ids, block_size, scheme=scheme, seed=seed)
    scorer = _scorer(weights, unknown_weight, block_size)
    # Per-block presence matters only for an instance in two media; without it the
    # match takes the index's fastest walk. An index that became multi-medium during
    # this match says so in the answer, and gets asked again.
    presence = getattr(index, "multi_medium", True)
    m = index.match(hashes, with_presence=presence)
    if not presence and m.multi_medium:
        m = index.match(hashes, with_presence=True)
    return m, scorer.scores(m)


def score_many(
    index,
    chains: Sequence[HashesLike],
    *,
    block_size: int | None = None,
    weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
    unknown_weight: float = UNKNOWN_TIER_WEIGHT,
) -> list[tuple[Match, list[InstanceScore]]]:
    """:func:`score_match` for many requests at once (a scheduler step), in order.

    One ``index.match_many`` answers them all from one consistent state, paying the
    fixed costs of a match once; each pair equals ``score_match`` on that chain.

    Cost: one ``match_many`` plus numpy work over the matched blocks.

    >>> import tempfile, sarp
    >>> with sarp.open(tempfile.mkdtemp()) as index:
    ...     _ = index.insert([1, 2, 3], holder="w0")
    ...     [[s.instance for s in scores] for _, scores in score_many(index, [[1, 2], [5]])]
    [['w0'], []]
    """
    scorer = _scorer(weights, unknown_weight, block_size)
    presence = getattr(index, "multi_medium", True)  # as score_match
    answers = index.match_many(chains, with_presence=presence)
    if not presence and any(m.multi_medium for m in answers):
        answers = index.match_many(chains, with_presence=True)
    return [(m, scorer.scores(m)) for m in answers]


def _scorer(weights: Mapping[str, float], unknown_weight: float,
            block_size: int | None) -> _Scorer:
    """A scorer with checked weights; the default weights' are checked once."""
    if weights is not DEFAULT_TIER_WEIGHTS or unknown_weight != UNKNOWN_TIER_WEIGHT:
        return _Scorer(weights, unknown_weight, block_size)
    scorer = _default_scorers.get(block_size) if type(block_size) in (int, type(None)) else None
    if scorer is None:
        scorer = _Scorer(weights, unknown_weight, block_size)  # raises for a bad block_size
        if len(_default_scorers) < 64:
            _default_scorers[block_size] = scorer
    return scorer


class _Scorer:
    """Weights checked once; the per-instance scores of a ``Match`` made with presence."""

    __slots__ = ("tier_weights", "unknown_weight", "block_size")

    def __init__(self, weights: Mapping[str, float], unknown_weight: float,
                 block_size: int | None) -> None:
        self.tier_weights = {canonical_medium(medium): _check_weight(medium, weight)
                             for medium, weight in weights.items()}
        self.unknown_weight = _check_weight("unknown media", unknown_weight)
        if block_size is not None and (isinstance(block_size, bool)
                                       or not isinstance(block_size, int) or block_size <= 0):
            raise ValueError(f"block_size={block_size!r}; pass the engine's block size, "
                             "an int > 0")
        self.block_size = block_size

    def weight_of(self, medium: str) -> float:
        tier = canonical_medium(medium)
        if tier in self.tier_weights:
            return self.tier_weights[tier]
        if tier not in _warned_unknown:
            _warned_unknown.add(tier)
            log.warning("sarp: medium %r has no weight; it counts %s (pass weights= or "
                        "unknown_weight= to set it)", tier, self.unknown_weight)
        return self.unknown_weight

    def scores(self, m: Match) -> list[InstanceScore]:
        out = []
        media_of: dict[str, list[str]] = {}
        if m.presence or m.multi_medium:
            for inst, medium in m.presence:
                media_of.setdefault(inst, []).append(medium)
        else:  # asked without presence: every instance is one holder, in one medium
            media_of = {inst: list(media) for inst, media in m.by_medium.items()}
        for instance, blocks in m.by_holder.items():
            media = media_of.get(instance, [])
            if len(media) == 1:
                # One medium holds all ``blocks`` (that is what the instance's prefix
                # means): every block weighs the same, no per-block work.
                medium = media[0]
                by_medium = {medium: blocks}
                score = blocks * self.weight_of(medium)
            else:
                media.sort()
                rows = np.stack([m.presence[(instance, medium)][:blocks] for medium in media])
                w = np.array([self.weight_of(medium) for medium in media])
                weighted = rows * w[:, None]
                counts = np.bincount(weighted.argmax(axis=0), minlength=len(media))
                by_medium = {medium: int(c) for medium, c in zip(media, counts, strict=True)
                             if c}
                score = float(weighted.max(axis=0).sum())
            engine, _, rank = instance.rpartition("#")
            dp_rank = int(rank) if engine and rank.isdigit() else None
            out.append(InstanceScore(
                instance=instance,
                engine=engine if dp_rank is not None else instance,
                dp_rank=dp_rank,
                matched_blocks=blocks,
                matched_tokens=None if self.block_size is None else blocks * self.block_size,
                by_medium=by_medium,
                score=round(score, 6),
            ))
        out.sort(key=lambda s: (-s.score, -s.matched_blocks, s.instance))
        return out


def _check_weight(medium: str, weight: object) -> float:
    if (isinstance(weight, bool) or not isinstance(weight, int | float)
            or not math.isfinite(weight) or weight < 0):
        raise ValueError(f"weight for {medium!r} is {weight!r}; pass a finite number >= 0")
    return float(weight)
