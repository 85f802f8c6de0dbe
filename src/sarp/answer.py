"""A match's answer (:class:`Match`), and how a walk's results become one: each
holder's prefix (a walk where every instance is one holder: :func:`plain_answer`), or
each holder's presence over the verified blocks (:func:`answer_of_rows`: the runs per
holder, per instance over its media, and the presence rows).  :mod:`sarp.verify` walks;
this names what it found.  Each C call here (``plain_result`` and ``rows_result``, in
``verify.c``) has its Python reference beside it (:func:`plain_runs`,
:func:`runs_of_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from . import native


@dataclass(slots=True)
class Match:
    """The verified answer for one query chain.

    ``num_blocks``: longest prefix of which every block is held by some holder.
    ``by_holder``: instance -> longest prefix that instance holds (any medium).
    ``by_medium``: instance -> {medium: longest prefix held in that medium}.
    ``meta``: (instance, medium) -> int64 metadata of that holder's prefix
    (``-1`` where none was stored); filled only by ``match(..., with_meta=True)``.
    ``storage_reads``: segment records read from LMDB to answer.
    ``presence``: (instance, medium) -> bool array over the ``num_blocks`` verified
    blocks, True where that holder has the block; filled only by
    ``match(..., with_presence=True)`` (the router's per-block tier view).
    ``multi_medium``: some instance held blocks in two media when this was answered
    (then ``by_holder`` is per instance over its media); when False, every instance
    is one holder, and ``by_medium[instance]`` has its one medium.
    ``holder_rows``: what ``by_medium`` and ``presence`` were made from, when the walk
    kept each holder's presence and ``with_presence`` was asked (else None); with
    ``with_presence="rows"`` the walk's rows alone, ``presence`` left empty
    (:func:`presence_of` makes it from them).
    """

    num_blocks: int
    by_holder: dict[str, int] = field(default_factory=dict)
    by_medium: dict[str, dict[str, int]] = field(default_factory=dict)
    meta: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    storage_reads: int = 0
    presence: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    multi_medium: bool = False
    holder_rows: HolderRows | None = field(default=None, repr=False, compare=False)


class HolderRows(NamedTuple):
    """Each holder's presence over a match's verified blocks as the walk kept it
    (holder id -> bytes of 0 and 1), and the names the match was answered with (holder
    id -> (instance, medium), a holder without one is not in the answer): what
    :func:`sarp.serving.rfc.answer_c` reads in one C call."""

    rows: dict[int, bytes]
    names: dict[int, tuple[str, str]]


def plain_answer(total: int, runs: dict[int, int], holder_names: dict[int, tuple[str, str]],
                 reads: int) -> Match:
    """The answer of a walk where each instance holds blocks in one medium: ``runs``,
    each holder's prefix by id, named (:func:`plain_runs`; in C, ``plain_result``)."""
    c = native.C
    if c is not None:
        by_holder, by_medium = c.plain_result(runs, holder_names)
    else:
        native.ran_python("plain_result")
        by_holder, by_medium = plain_runs(runs, holder_names)
    return Match(total, by_holder, by_medium, {}, reads, {}, False)


def plain_runs(runs: dict[int, int], holder_names: dict[int, tuple[str, str]]
               ) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """``by_holder`` and ``by_medium`` of a walk where each instance is one holder:
    each named holder with a prefix (a holder without a verified name is left out).
    The reference of C's ``plain_result``.

    >>> plain_runs({3: 2, 4: 0, 5: 1}, {3: ("a", "GPU"), 4: ("b", "GPU")})
    ({'a': 2}, {'a': {'GPU': 2}})
    """
    by_holder: dict[str, int] = {}
    by_medium: dict[str, dict[str, int]] = {}
    for holder_id, blocks in runs.items():
        if blocks and holder_id in holder_names:
            instance, medium = holder_names[holder_id]
            by_holder[instance] = blocks
            by_medium[instance] = {medium: blocks}
    return by_holder, by_medium


def answer_of_rows(total: int, rows: dict[int, bytes], holder_names: dict[int, tuple[str, str]],
                   instance_of: list[int] | None, instance_names: list[str], reads: int,
                   with_presence: bool | str) -> Match:
    """A match's answer from each holder's presence over its ``total`` verified blocks
    (holder id -> bytes of 0 and 1), its runs by :func:`runs_of_rows`.  Cost: one C
    call (``rows_result``), and a numpy array per named holder with presence (not
    with ``with_presence="rows"``)."""
    c = native.C
    args = (rows, holder_names, instance_of, instance_names, total)
    if c is not None:
        by_holder, by_medium = c.rows_result(*args)
    else:
        native.ran_python("rows_result")
        by_holder, by_medium = runs_of_rows(*args)
    kept = HolderRows(rows, holder_names) if with_presence else None
    presence = presence_of(kept) if with_presence and with_presence != "rows" else {}
    return Match(total, by_holder, by_medium, {}, reads, presence, instance_of is not None,
                 kept)


def presence_of(kept: HolderRows) -> dict[tuple[str, str], np.ndarray]:
    """``Match.presence`` from the walk's rows: a bool array per named holder (about a
    µs each, which a ``/query`` answered from the rows in C does without)."""
    return {name: np.frombuffer(row, bool) for holder_id, row in kept.rows.items()
            if (name := kept.names.get(holder_id)) is not None}


def runs_of_rows(rows: dict[int, bytes], holder_names: dict[int, tuple[str, str]],
                 instance_of: list[int] | None, instance_names: list[str], total: int
                 ) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """A match's ``by_holder`` and ``by_medium`` from each holder's presence over its
    ``total`` verified blocks (bytes of 0 and 1, by holder id): a holder's prefix is its
    leading run; an instance's over its media (``instance_of``, by holder id; None:
    each instance is one holder) is the leading run of its rows ORed.  A holder without
    a name, or newer than ``instance_of``, is in no answer.  The reference of C's
    ``rows_result``.  Cost: a ``bytes.find`` per holder, an OR of big ints per instance
    held in two media.

    >>> names = {0: ("a", "GPU"), 1: ("a", "CPU"), 2: ("b", "GPU")}
    >>> runs_of_rows({0: b"\\x01\\x00\\x01", 1: b"\\x00\\x01\\x00", 2: b"\\x00\\x00\\x00"},
    ...              names, [0, 0, 1], ["a", "b"], 3)
    ({'a': 3}, {'a': {'GPU': 1}})
    """
    by_holder: dict[str, int] = {}
    by_medium: dict[str, dict[str, int]] = {}
    grouped: dict[int, list[bytes]] = {}
    known = len(instance_of) if instance_of is not None else 0
    for holder_id, row in rows.items():
        name = holder_names.get(holder_id)
        if name is None:
            continue
        gap = row.find(0)
        run = len(row) if gap < 0 else gap
        instance, medium = name
        if run:
            by_medium.setdefault(instance, {})[medium] = run
        if instance_of is None:
            if run:
                by_holder[instance] = run
        elif holder_id < known:  # a holder newer than the names: no instance
            grouped.setdefault(instance_of[holder_id], []).append(row)
    for i, held_rows in grouped.items():
        if i < 0:
            continue
        if len(held_rows) > 1:  # bytes of 0 and 1: ORed as big ints, byte by byte
            held = 0
            for row in held_rows:
                held |= int.from_bytes(row, "big")
            held_rows = [held.to_bytes(total, "big")]
        gap = held_rows[0].find(0)
        run = total if gap < 0 else gap
        if run:
            by_holder[instance_names[i]] = run
    return by_holder, by_medium
