"""The general write path of an insert: every block of its chain looked up, the
stored ones checked against the position and parent the insert claims and given the
holder, the runs of new ones packed by the placement rule.  It is the reference the
walking path (:meth:`sarp.packing.Packer._walk_insert`) is tested against
(``packing.WALKING = False``), and it takes what the walk leaves: a stored block the
walk cannot reach, a conflict (which it names).

:class:`GeneralPath` is mixed into :class:`sarp.packing.Packer` (it works on the
packer's segment size, its holders and its split).
"""

from __future__ import annotations

import numpy as np

from .errors import ChainConflictError
from .segment import Segment
from .store import WriteTxn
from .writeset import Plan, Touched

SPLIT_TAIL_BLOCKS = 4  # measured in docs/performance.md (the split-tail sweep)


class GeneralPath:
    """The general path of :class:`sarp.packing.Packer` (see the module)."""

    def _general_insert(self, w: WriteTxn, touched: Touched, plan: Plan, chain: np.ndarray,
                        parent: int | None, name: str, meta: np.ndarray | None) -> None:
        """An insert with every block looked up (see :meth:`Packer.add_insert`)."""
        start_pos, parent_at = 0, None
        if parent is not None:
            parent_at = self._held_parent(w, touched, parent)
            seg = touched.get(parent_at[0])
            start_pos = seg.start_pos + parent_at[1] + 1
        seg_ids, offsets = w.locate(chain)
        self._check_existing(touched, chain, parent, start_pos, seg_ids, offsets)
        holder_id = self._holder_for_insert(w, touched, plan, name)
        self._mark_existing(touched, seg_ids, offsets, holder_id, meta)
        new = np.flatnonzero(seg_ids == 0)
        if new.size:
            breaks = np.flatnonzero(np.diff(new) != 1) + 1
            for run in np.split(new, breaks):
                i, j = int(run[0]), int(run[-1]) + 1
                prev_at = (int(seg_ids[i - 1]), int(offsets[i - 1])) if i > 0 else parent_at
                self._pack_run(w, touched, chain, i, j, start_pos, parent, prev_at, holder_id, meta)
            plan.new_blocks += int(new.size)

    def _check_existing(
        self,
        touched: Touched,
        chain: np.ndarray,
        parent: int | None,
        start_pos: int,
        seg_ids: np.ndarray,
        offsets: np.ndarray,
    ) -> None:
        """Refuse an insert whose already-stored blocks sit elsewhere than it claims."""
        for seg_id in np.unique(seg_ids[seg_ids != 0]).tolist():
            idx = np.flatnonzero(seg_ids == seg_id)
            seg = touched.get(seg_id)
            offs = offsets[idx].astype(np.int64)
            # With chained hashes a stored block's position and parent always agree
            # with the insert; if they do not, refuse before anything is written.
            stored = np.where(offs > 0, seg.hashes[np.maximum(offs - 1, 0)], seg.parent or 0)
            claimed = np.where(idx > 0, chain[np.maximum(idx - 1, 0)], parent or 0)
            bad = np.flatnonzero((seg.start_pos + offs != start_pos + idx) | (stored != claimed))
            if bad.size:
                b = int(bad[0])
                raise ChainConflictError(
                    f"hash {int(chain[idx[b]])} is stored at position {seg.start_pos + offs[b]} "
                    f"after {int(stored[b])}, but this insert puts it at position "
                    f"{start_pos + idx[b]} after {int(claimed[b])}; block hashes must be "
                    "chained (a hash names its whole prefix)"
                )

    def _mark_existing(
        self,
        touched: Touched,
        seg_ids: np.ndarray,
        offsets: np.ndarray,
        holder_id: int,
        meta: np.ndarray | None,
    ) -> None:
        """Add the holder to blocks already stored (checked by ``_check_existing``)."""
        for seg_id in np.unique(seg_ids[seg_ids != 0]).tolist():
            idx = np.flatnonzero(seg_ids == seg_id)
            seg = touched.get(seg_id)
            offs = offsets[idx].astype(np.int64)
            row = seg.row_of(holder_id)
            seg.presence[row, offs] = 1
            if meta is not None:
                seg.set_meta(row, offs, meta[idx])

    def _pack_run(
        self,
        w: WriteTxn,
        touched: Touched,
        chain: np.ndarray,
        i: int,
        j: int,
        start_pos: int,
        parent: int | None,
        prev_at: tuple[int, int] | None,
        holder_id: int,
        meta: np.ndarray | None,
    ) -> None:
        """Store new blocks ``chain[i:j]`` where :func:`placement` says: fill the parent's
        segment, then new ones."""
        seg = touched.get(prev_at[0]) if prev_at is not None else None
        split_at, fill, sizes = placement(None if seg is None else seg.num_blocks,
                                          None if seg is None else prev_at[1], j - i,
                                          self.segment_blocks)
        if split_at is not None:
            self._split(w, touched, seg, split_at)
        if fill:
            base = seg.num_blocks
            seg.append(chain[i : i + fill], holder_id, None if meta is None else meta[i : i + fill])
            w.put_blocks(chain[i : i + fill], seg.seg_id, base)
            i += fill
        for k in sizes:
            seg = new_run_segment(w.new_segment_id(), chain, i, k, start_pos, parent,
                                  holder_id, meta)
            touched.add_new(seg)
            w.put_blocks(seg.hashes, seg.seg_id, 0)
            i += k


def new_run_segment(seg_id: int, chain: np.ndarray, i: int, k: int, start_pos: int,
                    parent: int | None, holder_id: int, meta: np.ndarray | None) -> Segment:
    """A new segment of the ``k`` new blocks ``chain[i:i+k]`` of an insert whose chain
    starts at position ``start_pos`` after ``parent``, held by ``holder_id``."""
    return Segment(
        seg_id=seg_id,
        start_pos=start_pos + i,
        parent=parent if i == 0 else int(chain[i - 1]),
        hashes=chain[i : i + k].copy(),
        holder_ids=np.array([holder_id], np.uint16),
        presence=np.ones((1, k), np.uint8),
        meta=None if meta is None else meta[i : i + k].reshape(1, k).copy(),
    )


def placement(seg_blocks: int | None, offset: int | None, count: int,
              cap: int) -> tuple[int | None, int, list[int]]:
    """The placement rule: where ``count`` new blocks go after the block at ``offset``
    of a segment of ``seg_blocks`` blocks (None, None: there is no such segment, the
    chain starts here).  Returns ``(split_at, fill, sizes)``: split that segment at
    offset ``split_at`` first (None: no split; a branch 1 to ``SPLIT_TAIL_BLOCKS``
    blocks before its end moves that dead-end tail out, so the live chain stays in
    one segment), then append ``fill`` blocks to it (it ends at the parent and has
    room), then start new segments of these sizes (up to ``cap`` blocks each).
    Both Python write paths call it; ``packing.c`` mirrors it.

    >>> placement(10, 9, 5, 12), placement(10, 7, 5, 12), placement(None, None, 5, 2)
    ((None, 2, [3]), (8, 4, [1]), (None, 0, [2, 2, 1]))
    """
    split_at, fill = None, 0
    if seg_blocks is not None:
        blocks = seg_blocks
        if 0 < blocks - 1 - offset <= SPLIT_TAIL_BLOCKS:
            split_at = blocks = offset + 1
        if offset == blocks - 1 and blocks < cap:
            fill = min(cap - blocks, count)
    rest = count - fill
    return split_at, fill, [min(cap, rest - at) for at in range(0, rest, cap)]

