"""The verifier: what a fetched segment proves about the query, vectorised per segment.

Only what this module confirms is ever returned by ``match``: blocks whose hashes
equal the query's at the same positions, held by the holders it names.
"""

from __future__ import annotations

import struct

import numpy as np

from .segment import RecordView, peek

_HOLDER_ID = struct.Struct("<H")


def examine(
    seg_id: int, record: bytes, query_bytes: bytes, start: int, parent: int | None
) -> tuple[int, int, list[int], list[int]] | None:
    """Everything one match step needs from a fetched record.

    Checks the record (checksum, layout) and that it sits at query position
    ``start`` right after ``parent`` (the query's previous block, ``None`` at 0), so
    even hashes that are not chained cannot match the wrong place.  Returns
    ``(same, any_run, holder_ids, runs)``: blocks equal to the query, then the held
    runs as :func:`held_runs` gives them; ``None`` when the record does not
    continue the query there.

    Cost: one xxh3 pass and one memcmp over the record; numpy only when the hashes
    differ or several holders share the record.
    """
    view = peek(seg_id, record)
    if view.start_pos != start or view.parent != parent:
        return None
    same = same_blocks(view, query_bytes, start)
    return (same, *held_runs(view, same))


def same_blocks(view: RecordView, query_bytes: bytes, start: int) -> int:
    """Leading blocks of the record equal to the query from block ``start`` on.

    ``query_bytes`` is the query as little-endian uint64 bytes.  The usual case,
    all equal, is one memcmp; a difference is located with numpy.

    Cost: O(blocks compared), in C.

    >>> from sarp.segment import Segment, peek
    >>> rec = Segment(1, 0, None, np.array([5, 6, 7], np.uint64), np.array([0], np.uint16),
    ...               np.ones((1, 3), np.uint8)).encode()
    >>> q = np.array([5, 6, 9], "<u8").tobytes()
    >>> same_blocks(peek(1, rec), q, 0), same_blocks(peek(1, rec), q[:16], 0)
    (2, 2)
    """
    m = min(view.num_blocks, len(query_bytes) // 8 - start)
    at = RecordView.HASHES_AT
    ours = view.record[at : at + 8 * m]
    theirs = query_bytes[8 * start : 8 * (start + m)]
    if ours == theirs:
        return m
    if m <= 64:
        # Short: XOR as little-endian ints; the lowest set bit is in the first
        # differing block (cheaper than building numpy arrays for a few blocks).
        diff = int.from_bytes(ours, "little") ^ int.from_bytes(theirs, "little")
        return ((diff & -diff).bit_length() - 1) // 64
    equal = np.frombuffer(ours, "<u8") == np.frombuffer(theirs, "<u8")
    return int(equal.argmin())


def held_runs(view: RecordView, limit: int) -> tuple[int, list[int], list[int]]:
    """Held runs over the first ``limit`` blocks of a record.

    Returns ``(any_run, holder_ids, runs)``: how many leading blocks some holder
    holds, the record's holder ids, and each one's leading run.  A record with one
    holder (the common case) is answered by one ``bytes.find``.
    """
    rec = view.record
    if view.num_holders == 1:
        gap = rec.find(b"\0", view.presence_at, view.presence_at + limit)
        run = limit if gap < 0 else gap - view.presence_at
        return run, [_HOLDER_ID.unpack_from(rec, view.holders_at)[0]], [run]
    presence = view_presence(view)
    any_run, runs = leading_runs(presence, limit)
    return any_run, view_holder_ids(view).tolist(), runs


def view_presence(view: RecordView) -> np.ndarray:
    n, nh = view.num_blocks, view.num_holders
    return np.frombuffer(view.record, np.uint8, nh * n, view.presence_at).reshape(nh, n)


def view_holder_ids(view: RecordView) -> np.ndarray:
    return np.frombuffer(view.record, "<u2", view.num_holders, view.holders_at)


def leading_runs(presence: np.ndarray, limit: int) -> tuple[int, np.ndarray]:
    """Held runs over the first ``limit`` blocks of a segment.

    Returns ``(any_run, row_runs)``: how many leading blocks some row holds, and for
    each row how many leading blocks that row holds (both capped at ``limit``).

    >>> leading_runs(np.array([[1, 1, 0], [1, 0, 0]], np.uint8), 3)
    (2, [2, 1])
    """
    window = presence[:, :limit]
    if window.shape[0] == 1:  # the common case: one holder has the whole segment
        row = window[0]
        run = limit if row.all() else int(row.argmin())
        return run, [run]
    held = window.any(axis=0)
    any_run = limit if held.all() else int(held.argmin())
    full = window.all(axis=1)
    runs = np.where(full, limit, window.argmin(axis=1)) if limit else np.zeros(len(window), int)
    return any_run, runs.tolist()


def group_rows(presence: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OR together the presence rows of each group (one instance's media).

    Returns ``(group_ids, grouped_presence)``, one row per distinct group.

    >>> ids, rows = group_rows(np.array([[1, 0], [0, 1], [1, 0]], np.uint8), np.array([4, 4, 2]))
    >>> ids.tolist(), rows.tolist()
    ([2, 4], [[1, 0], [1, 1]])
    """
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    return sorted_groups[starts], np.maximum.reduceat(presence[order], starts, axis=0)
