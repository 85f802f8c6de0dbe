"""``sarp repair PATH --out NEW``: a new index from every record that can still be read.

Segment records verify themselves (magic, layout, xxh3 checksum), so whatever the
damage above them, each one that can be reached is either whole or refused.  Repair:

1. reads the holder names and the segment-id counter from the damaged index (in a
   child process; a damaged name fails its checksum and its holder is dropped);
2. asks for every segment id up to the counter by key, through LMDB's live tree (so
   never a stale copy from a free page), in child processes: a damaged page may kill
   one (SIGBUS, an LMDB assertion); the parent knows the last id it was sent, marks
   the next one lost and goes on after it;
3. keeps the records that decode (checksum, layout), and rebuilds: segments in order
   of position, each chain laid down first under a scaffold holder so that every
   block keeps its place, then each holder's runs of blocks inserted as they were
   held (with their metadata), then the scaffold cleared.  A segment whose parent
   block was lost cannot be placed and is lost with it;
4. reports what was kept and lost.  ``NEW`` passes ``sarp verify``; the damaged index
   is only read.

Cost: one LMDB ``get`` per segment id, one process per damaged region met, and the
inserts of every kept block.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import CorruptRecordError, NotAnIndexError, ParentNotFoundError
from .salvage import salvage_meta, salvage_records
from .segment import Segment, decode
from .store import ID_STRIDE

SCAFFOLD = "sarp.repair.scaffold"
_PROBE_IDS_PAST_COUNTER = 1024 * ID_STRIDE  # when the counter itself is unreadable, probe this far
MAX_SKIP = 4096  # ids skipped at once after children keep dying on the same region


@dataclass(slots=True)
class RepairReport:
    segments_found: int = 0
    segments_damaged: int = 0  # a record that failed its checksum or layout
    segments_unreadable: list[int] = field(default_factory=list)  # their page killed a read
    segments_unplaced: int = 0  # their parent block was lost
    blocks_kept: int = 0
    holders_kept: int = 0
    holders_lost: list[int] = field(default_factory=list)  # names failing their checksums

    def lines(self) -> list[str]:
        return [
            f"segments: {self.segments_found} found, {self.segments_damaged} damaged records "
            f"dropped, {len(self.segments_unreadable)} unreadable ids "
            f"{self.segments_unreadable[:10]}{'...' if len(self.segments_unreadable) > 10 else ''}"
            f", {self.segments_unplaced} unplaced (parent lost)",
            f"blocks kept: {self.blocks_kept}",
            f"holders: {self.holders_kept} kept, {len(self.holders_lost)} lost (damaged names "
            f"{self.holders_lost[:10]})",
        ]


def repair(path: str | Path, out: str | Path, *, durability: str = "sync") -> RepairReport:
    """Salvage the index at ``path`` into a new index at ``out`` (which must not exist).

    >>> import tempfile, sarp, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with sarp.open(d / "old") as index:
    ...     _ = index.insert([1, 2, 3], holder="w0")
    >>> report = repair(d / "old", d / "new")
    >>> report.blocks_kept, sarp.open(d / "new").match([1, 2, 3]).by_holder
    (3, {'w0': 3})
    """
    import sarp

    path, out = Path(path), Path(out)
    if not (path / "data.mdb").is_file():
        raise NotAnIndexError(f"{path} holds no data.mdb; pass the folder of a sarp index")
    if out.exists():
        raise ValueError(f"--out {out} exists; pass a new folder (repair never overwrites)")
    report = RepairReport()
    ctx = multiprocessing.get_context("spawn")
    meta = _in_child(ctx, salvage_meta, str(path)) or {"next_seg_id": None, "names": {}}
    names = {h: n for h, n in meta["names"].items() if n is not None}
    report.holders_lost = sorted(h for h, n in meta["names"].items() if n is None)
    last_id = meta["next_seg_id"] or _PROBE_IDS_PAST_COUNTER
    segments = _salvage(ctx, str(path), last_id, report)
    with sarp.open(out, durability=durability) as index:
        _rebuild(index, segments, names, report)
        report.blocks_kept = int(index.stats()["blocks"])
    return report


def _in_child(ctx, target, *args):
    here, there = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, there))
    proc.start()
    there.close()
    try:
        return here.recv()
    except EOFError:
        return None
    finally:
        proc.join()


def _salvage(ctx, path: str, last_id: int, report: RepairReport) -> list[Segment]:
    """Every readable, verified segment with id 1..last_id, one child per damaged region."""
    segments: list[Segment] = []
    next_id, dead_in_a_row = 1, 0
    while next_id <= last_id:
        here, there = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=salvage_records, args=(path, next_id, last_id, there))
        proc.start()
        there.close()
        done = False
        while True:
            try:
                item = here.recv()
            except EOFError:
                break  # the child died on a damaged page
            if item is None:
                done = True
                break
            seg_id, record = item
            next_id, dead_in_a_row = seg_id + 1, 0
            if record is None:
                continue
            if record == b"":
                report.segments_unreadable.append(seg_id)
                continue
            try:
                segments.append(decode(seg_id, record))
                report.segments_found += 1
            except CorruptRecordError:
                report.segments_damaged += 1
        proc.join()
        if done:
            break
        # The id whose read killed the child; when children keep dying at once (a
        # damaged branch page covers a range of ids), skip ahead exponentially so
        # the time stays bounded: those ids are reported unreadable.
        skip = min(1 << dead_in_a_row, MAX_SKIP)
        report.segments_unreadable.extend(range(next_id, min(next_id + skip, last_id + 1)))
        next_id += skip
        dead_in_a_row += 1
    return segments


def _rebuild(index, segments: list[Segment], names: dict[int, str],
             report: RepairReport) -> None:
    kept_holders: set[int] = set()
    for seg in sorted(segments, key=lambda s: (s.start_pos, s.seg_id)):
        try:
            index.insert(seg.hashes, parent=seg.parent, holder=SCAFFOLD)
        except (ParentNotFoundError, ValueError):
            report.segments_unplaced += 1  # its parent's segment was lost (or damaged)
            continue
        for row, holder_id in enumerate(seg.holder_ids.tolist()):
            name = names.get(int(holder_id))
            if name is None:
                continue  # a holder whose name is lost: its blocks are not claimed
            instance, medium = name.split("\0", 1)
            kept_holders.add(int(holder_id))
            held = seg.presence[row].astype(bool)
            for start, stop in _runs(held):
                parent = seg.parent if start == 0 else int(seg.hashes[start - 1])
                meta = None if seg.meta is None else seg.meta[row, start:stop]
                if meta is not None and (meta < 0).any():
                    meta = None  # a run with blocks lacking metadata is kept without it
                index.insert(seg.hashes[start:stop], parent=parent, holder=instance,
                             medium=medium, meta=meta)
    index.clear(SCAFFOLD)
    report.holders_kept = len(kept_holders)


def _runs(held: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], held.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))
