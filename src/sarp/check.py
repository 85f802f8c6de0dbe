"""The invariant checker: compares every structure with the segments, reports all problems.

Public through :meth:`sarp.Index.check` and ``sarp verify PATH``.  It keeps going
after a problem and names where each one is.
"""

from __future__ import annotations

from .directory import Directory
from .errors import CorruptRecordError
from .filters import HolderSegments
from .segment import decode
from .store import ReadTxn


def check(r: ReadTxn, directory: Directory, holders: HolderSegments) -> list[str]:
    """Every problem found, as one line each; an empty list means consistent.

    ``directory`` and ``holders`` must describe the state ``r`` reads.

    Cost: one scan of the segments, of the blocks table and of the aliases.
    """
    problems: list[str] = []
    expected_blocks: dict[int, tuple[int, int]] = {}
    expected_directory: dict[int, int] = {}
    expected_holders: dict[int, set[int]] = {}
    for seg_id, record in _guarded(r.raw_segments(), problems):
        try:
            seg = decode(seg_id, record)
        except CorruptRecordError as exc:
            problems.append(str(exc))
            continue
        where = f"segment {seg_id}"
        if seg.num_blocks == 0:
            problems.append(f"{where}: no blocks")
            continue
        if (seg.start_pos == 0) != (seg.parent is None):
            problems.append(f"{where}: starts at {seg.start_pos} but parent is {seg.parent}")
        if not seg.holder_ids.size or not seg.presence.any(axis=1).all():
            problems.append(f"{where}: a holder row holds nothing (or no rows at all)")
        if len(set(seg.holder_ids.tolist())) != seg.holder_ids.size:
            problems.append(f"{where}: a holder has two rows")
        for offset, h in enumerate(seg.hashes.tolist()):
            if h in expected_blocks:
                other = expected_blocks[h][0]
                problems.append(f"{where}: block {h} is also stored in segment {other}")
            expected_blocks[h] = (seg_id, offset)
        expected_directory[int(seg.hashes[0])] = seg_id
        for holder_id in seg.holder_ids.tolist():
            expected_holders.setdefault(holder_id, set()).add(seg_id)
    try:
        for h, seg_id, offset in r.blocks():
            want = expected_blocks.pop(h, None)
            if want != (seg_id, offset):
                problems.append(f"blocks table: {h} -> ({seg_id}, {offset}), segments say "
                                f"{want}")
    except CorruptRecordError as exc:
        problems.append(f"{exc}; the rest of the blocks table was not checked")
        expected_blocks.clear()
    for h, want in expected_blocks.items():
        problems.append(f"blocks table: {h} missing, stored in segment {want[0]} at {want[1]}")
    _check_log(r, problems)
    problems += r.aliases_problems()
    got = directory.entries()
    for h in sorted(got.keys() | expected_directory.keys()):
        if got.get(h) != expected_directory.get(h):
            problems.append(
                f"directory: {h} -> {got.get(h)}, segments say {expected_directory.get(h)}"
            )
    got_holders = holders.as_sets()
    for holder_id in sorted(got_holders.keys() | expected_holders.keys()):
        have, want = got_holders.get(holder_id, set()), expected_holders.get(holder_id, set())
        if have != want:
            problems.append(
                f"holder filter {holder_id}: extra segments {sorted(have - want)[:5]}, "
                f"missing {sorted(want - have)[:5]}"
            )
    return problems


def _check_log(r: ReadTxn, problems: list[str]) -> None:
    """The log runs on without a hole from what was trimmed to the newest sequence (a
    reader behind a hole would miss those changes; it reloads when it meets one)."""
    trimmed, newest = r.counter("log_trimmed_upto"), r.counter("next_seq")
    expect = trimmed + 1
    for seq, _, _ in r.log_since(trimmed):
        if seq != expect:
            problems.append(f"log: entries {expect}..{seq - 1} are missing (trimmed up to "
                            f"{trimmed}, newest {newest})")
        expect = seq + 1
    if expect <= newest:
        problems.append(f"log: entries {expect}..{newest} are missing (trimmed up to "
                        f"{trimmed})")


def _guarded(entries, problems: list[str]):
    """Yield from ``entries`` until a damaged one; that one becomes a problem line."""
    try:
        yield from entries
    except CorruptRecordError as exc:
        problems.append(f"{exc}; the rest of the table was not checked")
