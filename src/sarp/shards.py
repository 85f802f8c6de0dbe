"""An index sharded by engine: each shard a namespace of its own (on a Valkey cluster,
spread over the nodes), written by the writer of its engines, and read whole here.

A writer opens its shard with ``sarp.open(url, shard="a")``; :func:`open_shards`
reads every shard registered under ``url`` and merges their answers.  An engine's
blocks live in one shard, so its prefix (``by_holder``, ``by_medium``, ``presence``,
``meta``) is exactly what one unsharded index fed the same stream gives.  The total
``num_blocks`` is the longest prefix the engines of one shard hold between them: the
unsharded index's whenever each engine holds the query's blocks as a prefix (as
engines' prefix caches do), and lower, never higher, when engines of two shards hold
alternate pieces of one chain.

>>> import sarp
>>> sarp.open_shards("/tmp/not-a-url")
Traceback (most recent call last):
  ...
ValueError: '/tmp/not-a-url': shards are namespaces of a Valkey server or cluster; pass valkey://HOST:PORT/NAMESPACE
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from .answer import Match
from .errors import IndexClosedError, NotAnIndexError
from .hashing import HashesLike, as_hashes
from .index import Index
from .index import open as open_index
from .store import shard_registry

log = logging.getLogger("sarp")


def merge(answers: Sequence[Match]) -> Match:
    """One answer from the shards' answers for one chain: each engine's prefix as its
    shard gave it (an engine named by two shards: the longer), the longest total.

    Cost: Python per engine named; numpy per presence row.

    >>> m = merge([Match(3, {"a": 3}, {"a": {"GPU": 3}}), Match(2, {"b": 2}, {"b": {"CPU": 2}})])
    >>> m.num_blocks, m.by_holder, m.by_medium
    (3, {'a': 3, 'b': 2}, {'a': {'GPU': 3}, 'b': {'CPU': 2}})
    """
    held = [m for m in answers if m.num_blocks]
    reads = sum(m.storage_reads for m in answers)
    multi_medium = any(m.multi_medium for m in answers)
    if len(held) < 2:  # one shard's engines, or none, hold a prefix
        return dataclasses.replace(held[0] if held else Match(0), storage_reads=reads,
                                   multi_medium=multi_medium)
    total = max(m.num_blocks for m in held)
    if not any(m.meta or m.presence for m in held):
        by_holder: dict[str, int] = {}
        by_medium: dict[str, dict[str, int]] = {}
        for m in held:
            by_holder.update(m.by_holder)
            by_medium.update(m.by_medium)
        if len(by_holder) == sum(len(m.by_holder) for m in held):  # each engine in one shard
            return Match(total, by_holder, by_medium, {}, reads, {}, multi_medium)
    out = Match(total, storage_reads=reads, multi_medium=multi_medium)
    for m in held:
        for instance, k in m.by_holder.items():
            out.by_holder[instance] = max(k, out.by_holder.get(instance, 0))
        for instance, media in m.by_medium.items():
            mine = out.by_medium.setdefault(instance, {})
            for medium, k in media.items():
                mine[medium] = max(k, mine.get(medium, 0))
        for key, values in m.meta.items():
            if key not in out.meta or values.size > out.meta[key].size:
                out.meta[key] = values
        for key, row in m.presence.items():
            padded = np.zeros(total, bool)
            padded[: row.size] = row
            if key in out.presence:
                padded |= out.presence[key]
            out.presence[key] = padded
    return out


class ShardedIndex:
    """Every shard of a sharded index, read as one (see the module); thread-safe.
    Use :func:`open_shards` to get one."""

    def __init__(self, path: str | os.PathLike, *, refresh_s: float) -> None:
        self.path = os.fspath(path)
        self.refresh_s = refresh_s
        self._shards: dict[str, Index] = {}
        self._lock = threading.RLock()
        self._checked = 0.0
        self._closed = False
        self._registry = shard_registry(path)
        try:
            self.refresh()
        except BaseException:
            self.close()
            raise

    def refresh(self) -> list[str]:
        """Open the shards registered since the last look; the names of those open.
        A shard registered whose writer has not created its index yet is looked for
        again at the next refresh.  Cost: one ``HGETALL``, and an open (a snapshot
        load) per new shard."""
        with self._lock:
            for name, location in self._registry.shards().items():
                if name in self._shards:
                    continue
                try:
                    self._shards[name] = open_index(location, readonly=True)
                except NotAnIndexError:  # registered, its writer not there yet: next time
                    log.info("sarp: shard %s of %s has no index yet", name, self.path)
            self._checked = time.monotonic()
            return sorted(self._shards)

    @property
    def shards(self) -> list[str]:
        return sorted(self._shards)

    @property
    def multi_medium(self) -> bool:
        """Some engine of some shard holds blocks in two media (see Index.multi_medium)."""
        return any(s.multi_medium for s in list(self._shards.values()))

    @property
    def closed(self) -> bool:
        return self._closed

    def _current(self) -> list[Index]:
        if self._closed:
            raise IndexClosedError(f"{self.path}: the sharded index is closed")
        if time.monotonic() - self._checked > self.refresh_s:  # a shard added meanwhile
            self.refresh()
        return [self._shards[name] for name in sorted(self._shards)]

    def match(self, hashes: HashesLike, *, with_meta: bool = False,
              with_presence: bool = False) -> Match:
        """:meth:`sarp.Index.match` on every shard, merged (:func:`merge`).

        Cost: each shard's match, their round trips to the nodes at once, the replies
        walked in C (:meth:`sarp.Index.match_each`), and a registry read every
        ``refresh_s``.
        """
        query = as_hashes(hashes)
        with self._lock:
            return merge(Index.match_each(self._current(), query, with_meta=with_meta,
                                          with_presence=with_presence))

    def match_many(self, chains: Sequence[HashesLike], *, with_meta: bool = False,
                   with_presence: bool = False) -> list[Match]:
        """:meth:`sarp.Index.match_many` on every shard, merged chain by chain (their
        reads sent at once, as :meth:`match`'s)."""
        queries = [as_hashes(c) for c in chains]
        with self._lock:
            shards = self._current()
            if queries:
                everything = np.concatenate(queries)
                for s in shards:
                    s.read_ahead(everything)
            per_shard = [s.match_many(queries, with_meta=with_meta,
                                      with_presence=with_presence) for s in shards]
            return [merge(answers) for answers in zip(*per_shard, strict=True)] \
                if per_shard else [Match(0) for _ in queries]

    def holders_list(self) -> list[tuple[str, str]]:
        """Every (instance, medium) any shard has seen."""
        with self._lock:
            return sorted({h for s in self._current() for h in s.holders_list()})

    def stats(self) -> dict[str, object]:
        """Each shard's :meth:`sarp.Index.stats`, by name, and their sums."""
        with self._lock:
            per = {name: self._shards[name].stats() for name in self.shards}
        total = {key: sum(s[key] for s in per.values()) for key in
                 ("segments", "blocks", "directory_entries", "holders", "memory_bytes",
                  "disk_bytes", "matches")}
        return {"shards": per, "readonly": True, **total}

    def close(self) -> None:
        with self._lock:
            for shard in self._shards.values():
                shard.close()
            if hasattr(self, "_registry"):
                self._registry.close()
            self._closed = True

    def __enter__(self) -> ShardedIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_shards(path: str | os.PathLike, *, refresh_s: float = 1.0) -> ShardedIndex:
    """Read every shard of the sharded index at ``path`` (``valkey://HOST:PORT/NS``) as
    one: each shard opened ``readonly=True`` beside its writer, answers merged, and
    shards registered later picked up within ``refresh_s`` seconds.

    Cost: one registry read and one reader open per shard.

    >>> import sarp
    >>> from sarp.bench.valkey_server import ValkeyServer
    >>> with ValkeyServer() as server:
    ...     url = server.url("sharded")
    ...     with sarp.open(url, shard="a") as a, sarp.open(url, shard="b") as b:
    ...         _ = a.insert([1, 2, 3], holder="w0")
    ...         _ = b.insert([1, 2], holder="w1")
    ...         with sarp.open_shards(url) as index:
    ...             index.shards, index.match([1, 2, 3, 4]).by_holder
    (['a', 'b'], {'w0': 3, 'w1': 2})
    """
    if isinstance(refresh_s, bool) or not isinstance(refresh_s, int | float) or not (
            0 <= refresh_s <= 3600):
        raise ValueError(f"refresh_s={refresh_s!r}; pass seconds from 0 to 3600")
    return ShardedIndex(path, refresh_s=refresh_s)
