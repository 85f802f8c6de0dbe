"""Holders: who holds blocks.  A holder is one (instance, medium) pair, stored under
the name ``instance\\0medium`` with a u16 id (:mod:`sarp.store`'s ``holders`` table);
an instance is an engine (its blocks in every medium together).

:class:`Holders` is the index's registry in memory: names by id, instances by name,
and which instance each id belongs to (what a match groups a multi-medium instance
by).  :meth:`Holders.ids_of` is the one place that says which ids a name covers.

>>> holders = Holders({0: "w0\\0GPU", 1: "w0\\0CPU", 2: "w1\\0GPU"})
>>> holders.ids_of("w0"), holders.ids_of("w0", "CPU"), holders.multi_medium
([0, 1], [1], True)
"""

from __future__ import annotations

import logging

import numpy as np

from .filters import HolderSegments

log = logging.getLogger("sarp")

DEFAULT_MEDIUM = "GPU"  # where an engine keeps blocks unless it says otherwise
SEP = "\0"
MAX_NAME_BYTES = 200  # holder and medium names: LMDB keys are at most 511 bytes


def holder_name(holder: object, medium: object) -> str:
    """The stored name of ``holder`` in ``medium``, checked: a ValueError names the fix.

    >>> holder_name("w3", "GPU")
    'w3\\x00GPU'
    """
    for label, value in (("holder", holder), ("medium", medium)):
        if not isinstance(value, str) or not value or SEP in value:
            raise ValueError(
                f"{label}={value!r}; pass a non-empty str without NUL, e.g. holder='w3', "
                "medium='GPU'"
            )
        try:
            size = len(value.encode())
        except UnicodeEncodeError:
            raise ValueError(f"{label}={value[:40]!r} is not valid text (a lone surrogate?); "
                             "pass a name that encodes as UTF-8") from None
        if size > MAX_NAME_BYTES:
            raise ValueError(f"{label} is {size} bytes in UTF-8; pass at most "
                             f"{MAX_NAME_BYTES} (e.g. 'engine-7#3')")
    return f"{holder}{SEP}{medium}"


def check_instance(holder: object, medium: object) -> None:
    """A clear's arguments: an instance name, and a medium or None (every medium)."""
    if medium is not None:
        holder_name(holder, medium)
    elif not isinstance(holder, str) or not holder:
        raise ValueError(f"holder={holder!r}; pass the instance name as a non-empty str")


def covers(instance: str, medium: str | None, name: tuple[str, str]) -> bool:
    """Is holder ``name`` (instance, medium) one of ``instance``'s in ``medium`` (None:
    in any medium)?  The one predicate behind clears and per-instance reads.

    >>> covers("w0", None, ("w0", "CPU")), covers("w0", "GPU", ("w0", "CPU"))
    (True, False)
    """
    return name[0] == instance and (medium is None or name[1] == medium)


def split_name(name: str) -> tuple[str, str]:
    """A stored holder name as (instance, medium)."""
    instance, medium = name.split(SEP, 1)
    return instance, medium


class Holders:
    """Holder ids <-> (instance, medium), as the store last said.

    ``names`` maps id -> stored name, or None for a name that failed its checksum:
    such an id is left out (its blocks count as held, but never under a name) and
    listed in ``damaged``.  Cost: O(holders) to build; lookups are dict reads.
    """

    __slots__ = ("names", "instances", "instance_names", "instance_of", "multi_medium",
                 "damaged")

    def __init__(self, names: dict[int, str | None] | None = None) -> None:
        names = names or {}
        self.damaged = sorted(h for h, name in names.items() if name is None)
        self.names: dict[int, tuple[str, str]] = {}  # id -> (instance, medium)
        self.instances: dict[str, int] = {}  # instance -> its number
        self.instance_names: list[str] = []
        self.instance_of: list[int] = []  # holder id -> instance number, -1: none
        self.multi_medium = False  # does any instance hold blocks in two media?
        for holder_id, name in sorted(names.items()):
            if name is not None:
                self.register(holder_id, name)
        top = max(names, default=-1)
        self.instance_of.extend([-1] * (top + 1 - len(self.instance_of)))

    def register(self, holder_id: int, name: str) -> None:
        """Learn (or re-learn, for an id reused) that ``holder_id`` is ``name``."""
        instance, medium = split_name(name)
        self.names[holder_id] = (instance, medium)
        inst = self.instances.setdefault(instance, len(self.instance_names))
        if inst == len(self.instance_names):
            self.instance_names.append(instance)
        else:
            self.multi_medium = True
        if holder_id >= len(self.instance_of):
            self.instance_of.extend([-1] * (holder_id + 1 - len(self.instance_of)))
        self.instance_of[holder_id] = inst

    def learn(self, named: list[tuple[int, str]]) -> None:
        """Register the ids a committed write named that are new (or reused)."""
        for holder_id, name in named:
            if self.names.get(holder_id) != split_name(name):
                self.register(holder_id, name)

    def ids_of(self, instance: str, medium: str | None = None) -> list[int]:
        """The ids of ``instance`` in ``medium`` (None: in every medium)."""
        return [h for h, name in self.names.items() if covers(instance, medium, name)]

    def reclaimable(self, avoid: set[int], filters: HolderSegments) -> int | None:
        """An id whose holder holds nothing (as committed) and is not in ``avoid``, for
        reuse when every id is taken; or None."""
        for holder_id in sorted(self.names):
            if holder_id not in avoid and not filters.segments(holder_id):
                log.info("sarp: holder ids are all taken; reusing %d (%s, which holds "
                         "nothing)", holder_id, "/".join(self.names[holder_id]))
                return holder_id
        return None


def held_blocks(r, filters: HolderSegments, holder_ids: list[int]) -> np.ndarray:
    """Every block ``holder_ids`` hold (as of read transaction ``r``), as sorted uint64.
    Cost: reads only their segments (found through their roaring filters)."""
    wanted = list(holder_ids)
    parts = [np.empty(0, np.uint64)]
    for seg_id in sorted({s for h in wanted for s in filters.segments(h)}):
        seg = r.segment(seg_id)
        rows = np.isin(seg.holder_ids, wanted)
        parts.append(seg.hashes[seg.presence[rows].any(axis=0)])
    return np.unique(np.concatenate(parts))


def names_version(r) -> tuple[int, int]:
    """Changes when a holder is added, renamed (an id reused) or forgotten: a reader
    reloads the names when it does."""
    return r.counter("next_holder_id"), r.counter("holder_changes")
