"""Working-set analysis: the prefix-cache hit rate at every LRU capacity, in one pass.

Mattson's observation: under LRU, a cache of capacity C holds exactly the top C
blocks of the recency stack, so one pass that records each access's stack depth
gives the hit rate of every capacity at once.  Here an access is a request's
block; the request is served against the cache as it was when it arrived, and its
blocks are then touched last block first (so the first block ends most recently
used).  Prefix semantics: block ``i`` of a request is reusable only if blocks
``0..i`` all are, so its hit needs capacity ``max(depth[0..i])`` (the running
maximum of the depths).

Depths come from the set of "alive" touch times (each block's latest touch): a
block last touched at time ``t`` sits at depth = number of alive times >= ``t``.
:class:`_AliveTimes` keeps that set as a bitmap with popcount prefix sums, so a
request's depths, kills and appends are a few numpy calls, whatever its length.

Sampling (SHARDS): only blocks whose mixed hash falls under a threshold are
tracked, depths are scaled by 1/rate, and a fixed sample size lowers the threshold
as needed.  With chained hashes depths increase along a request (each prefix
block was touched after the blocks behind it), so sampled positions keep the
prefix semantics.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..hashing import HashesLike, as_hashes, splitmix64

_WORD_BITS = 64
_SUPER_WORDS = 256  # words per superblock of popcount prefix sums
UNSEEN = np.iinfo(np.int64).max


class _AliveTimes:
    """A set of touch times (ints from 0 up) with fast 'how many alive >= t'.

    Bits in uint64 words; per word, the popcount prefix sum inside its superblock;
    per superblock, its total.  Cost per call: O(k) for k times, plus O(256) per
    superblock an update touches.
    """

    def __init__(self, capacity_times: int = 1 << 16) -> None:
        words = max(_SUPER_WORDS, -(-capacity_times // _WORD_BITS))
        words = -(-words // _SUPER_WORDS) * _SUPER_WORDS
        self.words = np.zeros(words, np.uint64)
        self.word_cum = np.zeros(words, np.int64)
        self.super_count = np.zeros(words // _SUPER_WORDS, np.int64)
        self.end = 0  # next time to hand out
        self.alive = 0

    def count_at_or_after(self, times: np.ndarray) -> np.ndarray:
        w = times >> 6
        s = w // _SUPER_WORDS
        shifted = self.words[w] >> (times & 63).astype(np.uint64)
        in_word = np.bitwise_count(shifted).astype(np.int64)
        in_super = self.super_count[s] - self.word_cum[w]
        after_super = np.cumsum(self.super_count[::-1])[::-1]  # suffix sums
        later = np.append(after_super[1:], 0)[s]
        return in_word + in_super + later

    def kill(self, times: np.ndarray) -> None:
        self._clear_bits(times)
        self.alive -= times.size

    def append(self, count: int) -> int:
        """Hand out ``count`` new alive times ``[start, start + count)``; return start."""
        start = self.end
        needed = start + count
        if needed > self.words.size * _WORD_BITS:
            self._grow(needed)
        self.end = needed
        if count:
            self._set_range(start, needed)
        self.alive += count
        return start

    def _set_range(self, start: int, end: int) -> None:
        """Set the bits of times ``[start, end)`` word by word (appends are contiguous)."""
        ones = np.uint64(0xFFFFFFFFFFFFFFFF)
        w0, w1 = start >> 6, (end - 1) >> 6
        low = ones << np.uint64(start & 63)
        high = ones >> np.uint64(63 - ((end - 1) & 63))
        if w0 == w1:
            self.words[w0] |= low & high
        else:
            self.words[w0] |= low
            self.words[w0 + 1 : w1] = ones
            self.words[w1] |= high
        self._recount(range(w0 // _SUPER_WORDS, w1 // _SUPER_WORDS + 1))

    def _recount(self, superblocks) -> None:
        for s in superblocks:
            lo = s * _SUPER_WORDS
            counts = np.bitwise_count(self.words[lo : lo + _SUPER_WORDS]).astype(np.int64)
            np.cumsum(counts, out=self.word_cum[lo : lo + _SUPER_WORDS])
            self.super_count[s] = self.word_cum[lo + _SUPER_WORDS - 1]

    def _clear_bits(self, times: np.ndarray) -> None:
        if not times.size:
            return
        t = _ascending(times)
        w = t >> 6
        masks = np.left_shift(np.uint64(1), (t & 63).astype(np.uint64))
        words, starts, _ = _runs(w)
        combined = np.bitwise_or.reduceat(masks, starts)
        self.words[words] &= ~combined
        self._recount(_runs(words // _SUPER_WORDS)[0].tolist())

    def _grow(self, needed_times: int) -> None:
        words = max(2 * self.words.size, -(-needed_times // _WORD_BITS))
        words = -(-words // _SUPER_WORDS) * _SUPER_WORDS
        for name in ("words", "word_cum"):
            old = getattr(self, name)
            new = np.zeros(words, old.dtype)
            new[: old.size] = old
            setattr(self, name, new)
        super_count = np.zeros(words // _SUPER_WORDS, np.int64)
        super_count[: self.super_count.size] = self.super_count
        self.super_count = super_count

    def nbytes(self) -> int:
        return self.words.nbytes + self.word_cum.nbytes + self.super_count.nbytes


@dataclass(slots=True)
class HitCurve:
    """Prefix hit counts by the capacity they need.

    ``needed[c]`` = accesses that hit at every capacity >= ``c`` blocks (and miss
    below); ``accesses`` counts every block requested (sampled ones, scaled, when
    sampling).  ``hit_rate(c)`` is exact for any ``c`` without sampling.
    """

    requests: int
    accesses: float
    needed: np.ndarray  # float64 weights by needed capacity (index = blocks)
    sample_rate: float = 1.0

    @property
    def unbounded_hit_rate(self) -> float:
        return float(self.needed.sum() / self.accesses) if self.accesses else 0.0

    def hit_rate(self, capacity_blocks: int) -> float:
        """Hit rate with an LRU cache of ``capacity_blocks`` blocks.

        >>> curve = analyze([[1, 2], [1, 2, 3], [1, 2, 3]])
        >>> curve.hit_rate(1), curve.hit_rate(2), curve.hit_rate(3)
        (0.25, 0.5, 0.625)
        """
        c = min(int(capacity_blocks), self.needed.size - 1)
        return float(self.needed[: c + 1].sum() / self.accesses) if self.accesses else 0.0

    def points(self) -> list[dict[str, float]]:
        """Every capacity where the rate changes, with the rate from there on."""
        cum = np.cumsum(self.needed)
        where = np.flatnonzero(self.needed)
        return [
            {"capacity_blocks": int(c), "hit_rate": float(cum[c] / self.accesses)}
            for c in where.tolist()
        ]

    def capacity_for(self, hit_rate: float) -> int | None:
        """Smallest capacity (blocks) reaching ``hit_rate``; ``None`` if none does.

        >>> analyze([[1, 2], [1, 2, 3], [1, 2, 3]]).capacity_for(0.5)
        2
        """
        if not 0 <= hit_rate <= 1:
            raise ValueError(f"hit_rate={hit_rate!r}; pass a fraction from 0 to 1")
        cum = np.cumsum(self.needed) / self.accesses if self.accesses else np.zeros(1)
        reached = np.flatnonzero(cum >= hit_rate * (1 - 1e-12))
        return int(reached[0]) if reached.size else None


class WorkingSet:
    """Stack depths of a stream of requests; ``curve()`` at any time.

    ``sample_rate`` < 1 tracks only blocks whose mixed hash is under the rate;
    ``sample_size`` caps the number of tracked blocks (lowering the rate as needed).
    Without either, every block is tracked and the curve is exact.

    >>> ws = WorkingSet()
    >>> for chain in ([1, 2], [1, 2, 3], [7]):
    ...     ws.observe(chain)
    >>> ws.curve().hit_rate(10)
    0.3333333333333333
    """

    def __init__(self, *, sample_rate: float = 1.0, sample_size: int | None = None) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate={sample_rate!r}; pass a fraction in (0, 1]")
        if sample_size is not None and (isinstance(sample_size, bool) or sample_size < 1):
            raise ValueError(f"sample_size={sample_size!r}; pass a positive int or None")
        self._threshold = int(sample_rate * (1 << 32))  # keep blocks with mix < threshold
        self._sample_size = sample_size
        self._times = _AliveTimes()
        self._last: dict[int, int] = {}  # block -> latest touch time
        self._by_mix: list[tuple[int, int]] = []  # max-heap (-mix, block) for sample_size
        self._needed = np.zeros(1024, np.float64)
        self._requests = 0
        self._accesses = 0.0
        self._sampled_accesses = 0
        self._sampled_weight = 0.0  # sum of 1/rate over sampled accesses

    def attach(self, index) -> WorkingSet:
        """Observe every request that ``index.match`` answers, from now on.

        Each match is one request: its blocks are the accesses.  Inserts are not
        observed separately: an engine inserts blocks of a request it just matched,
        so they are already counted (and touched in the order the model assumes).

        >>> import tempfile, sarp
        >>> with sarp.open(tempfile.mkdtemp()) as index:
        ...     ws = WorkingSet(sample_rate=1.0).attach(index)
        ...     _ = index.match([1, 2]); _ = index.insert([1, 2], holder="w0")
        ...     _ = index.match([1, 2, 3])
        ...     round(ws.curve().hit_rate(2), 3)
        0.4
        """
        index.observe_matches(self.observe)
        return self

    @property
    def sample_rate(self) -> float:
        return self._threshold / (1 << 32)

    def observe(self, hashes: HashesLike) -> None:
        """Account for one request's chain of block hashes.

        Cost: O(n) numpy work for n blocks, plus a dict lookup per *tracked* block.
        """
        chain = as_hashes(hashes)
        self._requests += 1
        self._accesses += chain.size
        if self._threshold < (1 << 32):
            mix = _mix32(chain)
            keep = mix < self._threshold
            chain, mix = chain[keep], mix[keep]
        else:
            mix = None
        if not chain.size:
            return
        blocks = chain.tolist()
        last = self._last
        prev = np.fromiter((last.get(b, -1) for b in blocks), np.int64, len(blocks))
        self._account(prev, 1.0 / self.sample_rate)
        self._touch(blocks, prev, mix)

    def observe_dense(self, ids: np.ndarray, prev: np.ndarray) -> None:
        """The exact, dict-free path for :func:`analyze`: ``prev`` are last touch times."""
        self._requests += 1
        self._accesses += ids.size
        self._account(prev, 1.0)

    def _account(self, prev: np.ndarray, scale: float) -> None:
        seen = prev >= 0
        depth = np.full(prev.size, UNSEEN, np.int64)
        if seen.any():
            depth[seen] = self._times.count_at_or_after(prev[seen])
            if scale != 1.0:
                depth[seen] = np.ceil(depth[seen] * scale).astype(np.int64)
        need = np.maximum.accumulate(depth)
        self._sampled_accesses += prev.size
        self._sampled_weight += scale * prev.size
        finite = need[need != UNSEEN]
        if finite.size:
            top = int(finite.max())
            if top >= self._needed.size:
                grown = np.zeros(max(top + 1, 2 * self._needed.size), np.float64)
                grown[: self._needed.size] = self._needed
                self._needed = grown
            values, _, counts = _runs(finite)  # a running maximum is already sorted
            self._needed[values] += scale * counts

    def _touch(self, blocks: list[int], prev: np.ndarray, mix: np.ndarray | None) -> None:
        if (prev >= 0).any():
            self._times.kill(prev[prev >= 0])
        start = self._times.append(len(blocks))
        n = len(blocks)
        for i, b in enumerate(blocks):  # per *tracked* block: the sample bounds this
            self._last[b] = start + (n - 1 - i)
        if self._sample_size is not None:
            self._bound_sample(blocks, prev, mix)
        if self._times.end > 4 * max(self._times.alive, 1 << 16):
            self._compact()

    def _bound_sample(self, blocks: list[int], prev: np.ndarray, mix: np.ndarray | None) -> None:
        mixes = (mix if mix is not None else _mix32(np.array(blocks, np.uint64))).tolist()
        for b, m, p in zip(blocks, mixes, prev.tolist(), strict=True):
            if p < 0:
                heapq.heappush(self._by_mix, (-m, b))
        gone = []
        while len(self._last) > self._sample_size:
            neg_mix, b = heapq.heappop(self._by_mix)
            self._threshold = -neg_mix  # keep only blocks below the evicted one's mix
            gone.append(self._last.pop(b))
        if gone:
            self._times.kill(np.array(gone, np.int64))

    def _compact(self) -> None:
        """Renumber alive times 0..alive-1 (order kept), so memory tracks the sample."""
        blocks = list(self._last)
        old = np.fromiter((self._last[b] for b in blocks), np.int64, len(blocks))
        order = np.argsort(old)
        new = np.empty_like(old)
        new[order] = np.arange(old.size)
        fresh = _AliveTimes(max(1 << 16, 2 * old.size))
        fresh.append(old.size)
        self._times = fresh
        self._last = dict(zip(blocks, new.tolist(), strict=True))

    def curve(self) -> HitCurve:
        """The hit curve of everything observed so far.

        When sampling, the difference between the accesses seen and the sampled
        weight is credited to the smallest capacity (SHARDS-adj, Waldspurger et al.,
        FAST'15): the usual cause is a very hot block (a shared first block) that
        the sample took or missed, and a hot block hits at the smallest capacities.
        """
        needed = self._needed.copy()
        if self._threshold < (1 << 32) and needed.size > 1:
            needed[1] = max(needed[1] + self._accesses - self._sampled_weight, 0.0)
        return HitCurve(self._requests, self._accesses, needed, self.sample_rate)

    def nbytes(self) -> int:
        """Memory of the tracked state (bitmap, per-block map at CPython's cost, curve)."""
        return self._times.nbytes() + 100 * len(self._last) + self._needed.nbytes


def _dense_ids(values: np.ndarray) -> np.ndarray:
    """Map values to 0..distinct-1 (same value, same id).

    Values spanning a small range (trace ids) go through a table indexed by value:
    2.1 s for the 48 M ids of the agentic trace, against 7.7 s for
    ``np.unique(..., return_inverse=True)``, which well-spread hashes still use
    (about 10.6 s there; an argsort or a vectorised hash table measured no faster).

    >>> _dense_ids(np.array([50, 7, 50, 9], np.uint64)).tolist()
    [2, 0, 2, 1]
    """
    if not values.size:
        return np.empty(0, np.int64)
    low, high = int(values.min()), int(values.max())
    if high - low < 4 * values.size:
        # Values in a small range (trace ids are small integers): a table, no sort.
        # The range is small, so offsets fit int64: view, don't convert (numpy would
        # copy a uint64 index array on every fancy-indexing use).
        offsets = (values - np.uint64(low)).view(np.int64)
        present = np.zeros(high - low + 1, bool)
        present[offsets] = True
        rank = np.cumsum(present, dtype=np.int32 if high - low < 2**31 else np.int64)
        dense = rank[offsets]
        dense -= 1
        return dense
    return np.unique(values, return_inverse=True)[1]


def _runs(ordered: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, first index, count) of each run of equal values in a sorted array.

    >>> [a.tolist() for a in _runs(np.array([2, 2, 5, 7, 7, 7]))]
    [[2, 5, 7], [0, 2, 3], [2, 1, 3]]
    """
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    counts = np.diff(np.append(starts, ordered.size))
    return ordered[starts], starts, counts


def _ascending(times: np.ndarray) -> np.ndarray:
    """``times`` sorted ascending; O(k) for the usual cases (already ascending, or
    descending: a request's previous touches, made last block first)."""
    if times.size < 2:
        return times
    step = np.diff(times)
    if (step > 0).all():
        return times
    if (step < 0).all():
        return times[::-1]
    return np.sort(times)


def _mix32(hashes: np.ndarray) -> np.ndarray:
    """A well-spread 32-bit value per hash, for sampling."""
    return (splitmix64(hashes) >> np.uint64(32)).astype(np.int64)


def analyze(requests: Iterable[Sequence[int] | np.ndarray], progress: bool = False) -> HitCurve:
    """Exact hit curve of a whole trace in one pass (every block tracked).

    Block hashes are first mapped to dense ids (one sort), so no Python work is
    done per block.  Cost: O(A log A) for A accesses, in numpy.

    >>> analyze([[1, 2], [1, 2]]).hit_rate(2)
    0.5
    """
    from tqdm import tqdm

    chains = [as_hashes(r) for r in requests]
    sizes = np.fromiter((c.size for c in chains), np.int64, len(chains))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    dense = _dense_ids(np.concatenate(chains)) if chains else np.empty(0, np.int64)
    last = np.full(int(dense.max()) + 1 if dense.size else 0, -1, np.int64)
    ws = WorkingSet()
    times = ws._times
    for r in tqdm(range(len(chains)), desc="working set", unit="req", disable=not progress):
        ids = dense[offsets[r] : offsets[r + 1]]
        prev = last[ids]
        ws.observe_dense(ids, prev)
        if (prev >= 0).any():
            times.kill(prev[prev >= 0])
        start = times.append(ids.size)
        last[ids] = start + np.arange(ids.size - 1, -1, -1)
    return ws.curve()


def simulate_lru(requests: Iterable[Sequence[int]], capacity_blocks: int) -> int:
    """Reusable blocks with one LRU block cache of ``capacity_blocks``, simulated directly.

    The reference the one-pass curve is checked against: per request, the longest
    cached prefix is reused; then every block is touched last block first, and
    blocks beyond the capacity are evicted least recently used first.

    Cost: O(blocks) dict operations, one capacity per call.

    >>> simulate_lru([[1, 2], [1, 2, 3], [1, 2, 3]], 2)
    4
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for chain in requests:
        blocks = chain if isinstance(chain, list) else np.asarray(chain).tolist()
        k = 0
        while k < len(blocks) and blocks[k] in cache:
            k += 1
        hits += k
        for b in reversed(blocks):
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return hits
