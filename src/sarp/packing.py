"""The segment packer: ``insert``, ``remove`` and ``clear`` as LMDB write transactions.

Each method runs inside one :meth:`sarp.store.Store.write` transaction and returns a
:class:`Plan` of what changed, which the index applies to memory only after the
commit (so a failed write changes nothing).  :meth:`Packer.batch` runs many of them
in one transaction, writing each touched segment once.  Packing rules
(docs/design.md):

* a block is stored once; inserting it again only adds the holder's presence bit,
  after checking it sits at the claimed position after the claimed parent;
* a run of new blocks fills its parent's segment when the parent is the last block
  and there is room, then new segments of up to ``segment_blocks`` blocks;
* a branch 1 to ``SPLIT_TAIL_BLOCKS`` blocks before a segment's end first moves that
  dead-end tail into a segment of its own, so the new chain stays inline;
* a segment none of whose blocks is held any more is deleted.

An insert finds its stored blocks by following segments from its parent and a
remove follows runs of consecutive blocks (:meth:`Packer._walk_insert`,
:meth:`Packer._remove_runs`), so neither looks every block up; anything the walk
cannot settle goes through the general path, which does (docs/design.md, "The
walking write path").
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import general, native
from .errors import ChainConflictError, CorruptRecordError, ParentNotFoundError
from .general import GeneralPath, new_run_segment, placement
from .holders import covers, split_name
from .segment import Segment
from .store import WriteTxn
from .writeset import Deaths, Plan, Touched

if TYPE_CHECKING:
    from .recovery import Memory


# A batch of at least this many operations writes its ``blocks`` entries at its end, in
# key order (``deferred``, :meth:`Packer._native_batch`); measured in docs/performance.md.
DEFERRED_MIN_OPS = 64
# The walking write path (inserts that follow segments from the parent, removes that
# follow runs); False: every operation takes the general path, which looks every block
# up: the reference the walking path is tested against.
WALKING = True
# Operations each Python path took, since the process began (tests assert the path).
TAKEN = {"walk_insert": 0, "general_insert": 0, "run_remove": 0, "general_remove": 0}


class Packer(GeneralPath):
    """Write transactions for one index: where blocks go, and what changed."""

    def __init__(self, segment_blocks: int, path: Path, memory: Memory) -> None:
        self.segment_blocks = segment_blocks
        self.path = path
        # the index's memory as committed: its directory names the segment each first
        # hash heads (the walking paths follow it), its filters the segments of each
        # holder (a clear visits only those), its holders the names
        self.memory = memory
        self.deaths = Deaths()  # the blocks its writes deleted, for the aliases' sweep

    def insert(
        self,
        w: WriteTxn,
        chain: np.ndarray,
        parent: int | None,
        name: str,
        meta: np.ndarray | None,
    ) -> Plan:
        """Store ``chain`` (after ``parent``) as held by holder ``name``.

        Cost: see :meth:`_walk_insert`; one record write per touched segment.
        """
        if meta is None and self._runs_in_c(w):
            return self._one(w, ("insert", chain, parent, name, None))
        native.ran_python("pack_batch")
        plan, touched = Plan(), Touched(w, self.deaths)
        self.add_insert(w, touched, plan, chain, parent, name, meta)
        touched.flush(plan)
        return plan

    def batch(self, w: WriteTxn, ops: list[tuple]) -> tuple[Plan, list[tuple[int, Exception]]]:
        """Apply many operations in one transaction; each touched segment is written once.

        ``ops`` are ``("insert", chain, parent, name, meta)``, ``("remove", chain,
        name)`` and ``("clear", instance, medium_or_None)``.  An operation that
        refuses (``ParentNotFoundError``, ``ChainConflictError``) is reported with its
        position and has written nothing; the others are applied in order.
        A clear covers the committed holder ids of its instance (and medium) and any
        this batch named.  On LMDB the operations run in C as far as they can
        (:meth:`_native_batch`), and Python carries on from the first it cannot take.

        Cost: the operations' lookups, then one record write per touched segment.
        """
        plan, touched = Plan(), Touched(w, self.deaths)
        failed: list[tuple[int, Exception]] = []
        start = 0
        if w.capabilities.prefetch:  # each lookup a round trip: all of them at once
            w.prefetch_blocks(_looked_up(ops))
            self._fetch_cleared(touched, {h for op in ops if op[0] == "clear"
                                          for h in self.memory.holders.ids_of(op[1], op[2])})
        if self._runs_in_c(w):
            start = self._native_batch(w, ops, len(ops), plan, touched, failed)
            if start == len(ops):
                return plan, failed  # flushed in C
        return self._python_batch(w, ops, start, plan, touched, failed)

    def batch_columns(self, w: WriteTxn, kinds: np.ndarray, sizes: np.ndarray,
                      hashes: np.ndarray, parents: np.ndarray, has_parent: np.ndarray,
                      names_at: np.ndarray, names: list[str]
                      ) -> tuple[Plan, list[tuple[int, Exception]]]:
        """:meth:`batch` of inserts and removes given as columns (a commit's
        :class:`sarp.serving.columns.Columns`, resolved): row ``i`` is an insert
        (``kinds`` 0) or a remove (1) of the next ``sizes[i]`` of ``hashes`` by
        ``names[names_at[i]]``, an insert after ``parents[i]`` when ``has_parent[i]``.

        Cost: as :meth:`batch`, without a Python tuple per row while C takes the rows.
        """
        n = int(kinds.size)
        plan, touched = Plan(), Touched(w, self.deaths)
        failed: list[tuple[int, Exception]] = []
        if w.capabilities.prefetch:
            w.prefetch_blocks(np.concatenate([hashes, parents[(has_parent != 0) & (kinds == 0)]]))
        start = 0
        if self._runs_in_c(w):
            start = self._native_batch(w, (kinds, sizes, hashes, parents, has_parent, names_at,
                                           names), n, plan, touched, failed)
            if start == n:
                return plan, failed
        ends = np.cumsum(sizes).tolist()
        ops = [("insert", hashes[ends[i] - int(sizes[i]) : ends[i]],
                int(parents[i]) if has_parent[i] else None, names[names_at[i]], None)
               if kinds[i] == 0 else
               ("remove", hashes[ends[i] - int(sizes[i]) : ends[i]], names[names_at[i]])
               for i in range(n)]
        return self._python_batch(w, ops, start, plan, touched, failed)

    def _python_batch(self, w: WriteTxn, ops: list[tuple], start: int, plan: Plan,
                      touched: Touched, failed: list[tuple[int, Exception]]
                      ) -> tuple[Plan, list[tuple[int, Exception]]]:
        """:meth:`batch` in Python, from operation ``start`` on."""
        native.ran_python("pack_batch")
        for i in range(start, len(ops)):
            op = ops[i]
            before = plan.removed_blocks
            try:
                if op[0] == "insert":
                    self.add_insert(w, touched, plan, *op[1:])
                elif op[0] == "remove":
                    self.add_remove(w, touched, plan, *op[1:])
                else:
                    ids = set(self.memory.holders.ids_of(op[1], op[2]))
                    ids.update(h for h, name in plan.holder_names
                               if covers(op[1], op[2], split_name(name)))
                    self.add_clear(touched, plan, sorted(ids))
            except (ParentNotFoundError, ChainConflictError) as exc:
                failed.append((i, exc))
            plan.removed_per_op.append(plan.removed_blocks - before)
        touched.flush(plan)
        return plan, failed

    def _runs_in_c(self, w: WriteTxn) -> bool:
        """Can a batch on ``w`` run in ``sarp._native.pack_batch``: the extension is
        built, the walking write path applies, and the store's reads are local (LMDB)
        or fetched ahead for the batch (Valkey)."""
        return native.C is not None and WALKING and (w.capabilities.local_reads
                                                     or w.capabilities.prefetch)

    def _one(self, w: WriteTxn, op: tuple) -> Plan:
        """One insert or remove as a batch of one (in C), raising what it refused with."""
        plan, failed = self.batch(w, [op])
        if failed:
            raise failed[0][1]
        return plan

    def _native_batch(self, w: WriteTxn, ops: list[tuple] | tuple, count: int, plan: Plan,
                      touched: Touched, failed: list[tuple[int, Exception]]) -> int:
        """Run ``ops`` in C from the first on, as :meth:`batch` would, until one that
        C leaves to Python (a clear, meta, a conflict, a claim that finds a stored
        block, a new holder when every id is taken); return how many ran there.
        When all did, the touched segments are flushed too; otherwise they are
        handed to ``touched`` and :meth:`batch` carries on.

        A batch of ``DEFERRED_MIN_OPS`` or more runs deferred first, in a
        transaction nested in ``w``: its ``blocks`` entries are written at its end in
        key order, where LMDB finds most of them on the leaf its cursor is already on,
        and a claim is proven by that write.  Should the table refuse one (a new block
        it has already), or anything go wrong, the nested transaction is dropped and
        the batch runs again as it always did, so the outcome is that run's.

        Cost: one liblmdb call per lookup, per ``blocks`` entry put or deleted and per
        record read or written (one py-lmdb call each where ``w.raw_tables()`` gives
        none: :func:`sarp.lmdb_env.raw_tables`); no Python per operation.
        """
        directory = self.memory.directory
        probe = (directory.lookup, *directory.probe_dicts(), directory.sorted_probe())
        out = None
        if count >= DEFERRED_MIN_OPS and w.capabilities.local_reads:
            nested = w.nested()
            try:
                out = native.C.pack_batch(_ctx(nested, probe), ops, self.segment_blocks,
                                          general.SPLIT_TAIL_BLOCKS, True)
            except Exception:
                # e.g. a damaged record: the run below meets it again and raises what
                # it always raised
                out = None
            if out is None:
                nested.abort()
            else:
                nested.commit()
        if out is None:
            out = native.C.pack_batch(_ctx(w, probe), ops, self.segment_blocks,
                                      general.SPLIT_TAIL_BLOCKS, False)
        done, new_blocks, removed_blocks, per_op, no_parent, names, created, rest = out
        plan.holder_names.extend(created)
        plan.new_blocks += new_blocks
        plan.removed_blocks += removed_blocks
        plan.removed_per_op.extend(per_op)
        failed.extend((i, self._no_parent(parent)) for i, parent in no_parent)
        if done == count:
            segments, dropped, entries, dead = rest
            plan.segments.extend(segments)
            plan.dropped.update(dropped)
            if dead:
                self.deaths.add(np.frombuffer(dead, np.uint64))
            if entries:
                w.log(entries)
        else:
            touched.take_over(rest, names)
        return done

    def add_insert(
        self,
        w: WriteTxn,
        touched: Touched,
        plan: Plan,
        chain: np.ndarray,
        parent: int | None,
        name: str,
        meta: np.ndarray | None,
    ) -> None:
        """Insert into ``touched`` (and the ``blocks`` table of ``w``).  Everything that
        can refuse is checked before anything is changed, so a refused insert inside a
        batch leaves no trace.

        The common shapes (a chain that continues stored blocks and then adds new ones
        at its end) take :meth:`_walk_insert`, which finds the stored blocks by
        following segments from the parent instead of looking every block up; any
        other shape, or a conflict, takes the general path below.
        """
        if WALKING and self._walk_insert(w, touched, plan, chain, parent, name, meta):
            TAKEN["walk_insert"] += 1
            return
        TAKEN["general_insert"] += 1
        self._general_insert(w, touched, plan, chain, parent, name, meta)

    def _holder_for_insert(self, w: WriteTxn, touched: Touched, plan: Plan, name: str) -> int:
        holder_id = touched.holder_id(name)
        if holder_id is None:
            taken = {h for h, _ in plan.holder_names} | touched.holder_ids()
            memory = self.memory
            holder_id = w.holder_id(name, create=True, reclaim=lambda: memory.holders.reclaimable(
                taken, memory.filters))
            touched.named(name, holder_id)
            plan.holder_names.append((holder_id, name))
        return holder_id

    def _walk_insert(
        self,
        w: WriteTxn,
        touched: Touched,
        plan: Plan,
        chain: np.ndarray,
        parent: int | None,
        name: str,
        meta: np.ndarray | None,
    ) -> bool:
        """Insert by walking: the stored prefix of ``chain`` is found by following
        segments from the parent (each block is stored once, either first in its
        segment or right after its predecessor), the rest is new and packed at the
        end.  The new blocks are claimed in the ``blocks`` table only if none of them
        is stored anywhere; otherwise (a stored block the walk cannot reach, or a
        claim that finds one) nothing is changed and it returns False for the
        general path.  ``ParentNotFoundError`` is raised as there.

        Cost: one lookup for the parent, one directory probe per segment boundary,
        a few numpy compares per segment, one put per new block; no lookup per block.
        """
        n = int(chain.size)
        if parent is None:
            seg, off, start_pos, prev = None, -1, 0, None
        else:
            parent_at = self._held_parent(w, touched, parent)
            seg, off = touched.get(parent_at[0]), parent_at[1]
            start_pos = seg.start_pos + off + 1
            prev = (seg, off)  # the block before chain[i]: the parent's, then each run's last
        runs: list[tuple[Segment, int, int, int]] = []  # (segment, offset, chain index, k)
        placements: list[tuple] = []
        taken: list[int] = []  # [the first segment id taken here], given back on a refusal
        i, stored, new = 0, -1, 0
        while i < n:
            nxt = off + 1
            if seg is not None and nxt < seg.hashes.size:
                k = _common_prefix(seg.hashes[nxt:nxt + n - i], chain[i:])
                if k:
                    runs.append((seg, nxt, i, k))
                    i += k
                    off = nxt + k - 1
                    prev = (seg, off)
                    continue
            # chain[i] is not next where the walk stands: it can only be stored as the
            # first block of a segment whose parent is chain[i - 1].
            head = int(chain[i])
            seg_id = touched.head(head)
            if seg_id is None:
                seg_id = self.memory.directory.lookup(head)
            if seg_id is not None:
                seg = touched.get(seg_id)
                if not seg.hashes.size or int(seg.hashes[0]) != head:
                    # the walk would ask for the same head again, for ever
                    raise CorruptRecordError(
                        f"segment {seg_id}: named for first hash {head}, but it starts with "
                        f"{int(seg.hashes[0]) if seg.hashes.size else 'nothing'}")
                if seg.parent != (int(chain[i - 1]) if i else parent) \
                        or seg.start_pos != start_pos + i:
                    return self._unplace(w, placements, taken)  # a conflict: the general path
                off = -1
                continue
            if i == stored:  # stored, but not where the walk can reach
                return self._unplace(w, placements, taken)
            # new blocks from i on, up to the first that is stored (a block evicted
            # under a child still held: the walk goes on from that child)
            end = n
            while (got := self._place_run(w, chain, i, end, start_pos, prev, taken)) is None:
                stored = i + int(np.flatnonzero(w.locate(chain[i:end])[0])[0])
                if stored == i:
                    return self._unplace(w, placements, taken)
                end = stored
            placements += got
            new += end - i
            i, seg, off = end, None, -1
        holder_id = self._holder_for_insert(w, touched, plan, name)
        for seg, at, j, k in runs:
            row = seg.row_of(holder_id)
            seg.presence[row, at : at + k] = 1
            if meta is not None:
                seg.set_meta(row, np.arange(at, at + k), meta[j : j + k])
        for target, split_at, j, k, _ in placements:
            if isinstance(target, Segment):
                if split_at is not None:
                    self._split(w, touched, target, split_at)
                target.append(chain[j : j + k], holder_id,
                              None if meta is None else meta[j : j + k])
            else:
                touched.add_new(new_run_segment(target, chain, j, k, start_pos, parent,
                                                holder_id, meta))
        plan.new_blocks += new
        return True

    @staticmethod
    def _unplace(w: WriteTxn, placements: list[tuple], taken: list[int]) -> bool:
        """Undo an insert's placements (their claims, and the segment ids from the
        first it took on) for the general path; False."""
        for p in placements:
            w.release_blocks(p[4])
        if taken:
            w.untake_segment_ids(taken[0])
        return False

    def _place_run(self, w: WriteTxn, chain: np.ndarray, i: int, end: int, start_pos: int,
                   prev: tuple | None, taken: list[int]) -> list[tuple] | None:
        """Where new blocks ``chain[i:end]`` go after the block ``prev`` (segment,
        offset; None: the chain starts at ``i``), as :meth:`_pack_run` packs them, with
        each placement's blocks claimed in the ``blocks`` table; None, with nothing of
        it claimed and its segment ids given back, if one of them is already stored.
        ``taken`` gets the first segment id an insert takes."""
        cap = self.segment_blocks
        placements: list[tuple] = []  # (segment or new id, split offset, chain index, k, hashes)
        run_ids: list[int] = []

        def claim(hashes: np.ndarray, seg_id: int, first_offset: int) -> bool:
            if w.claim_blocks(hashes, seg_id, first_offset):
                return True
            for done in placements:
                w.release_blocks(done[4])
            if run_ids:
                w.untake_segment_ids(run_ids[0])
            return False

        split_at, fill, sizes = placement(None if prev is None else prev[0].hashes.size,
                                          None if prev is None else prev[1], end - i, cap)
        if fill:
            seg = prev[0]
            if not claim(chain[i : i + fill], seg.seg_id, prev[1] + 1):
                return None
            placements.append((seg, split_at, i, fill, chain[i : i + fill]))
            i += fill
        for k in sizes:
            seg_id = w.new_segment_id()
            run_ids.append(seg_id)
            if not claim(chain[i : i + k], seg_id, 0):
                return None
            placements.append((seg_id, None, i, k, chain[i : i + k]))
            i += k
        if run_ids and not taken:
            taken.append(run_ids[0])
        return placements

    def _held_parent(self, w: WriteTxn, touched: Touched, parent: int) -> tuple[int, int]:
        seg_id, offset = w.locate_one(parent)
        if seg_id:
            seg = touched.get(seg_id)
            if np.count_nonzero(seg.presence[:, offset]):
                return seg_id, offset
        raise self._no_parent(parent)

    def _no_parent(self, parent: int) -> ParentNotFoundError:
        return ParentNotFoundError(
            f"parent={parent} is not held by any holder in {self.path}; insert the chain "
            "from its first block (parent=None) or from a block that is still stored"
        )


    def _split(self, w: WriteTxn, touched: Touched, seg: Segment, at: int) -> None:
        """Move ``seg``'s blocks from offset ``at`` on into a new segment."""
        tail = Segment(
            seg_id=w.tail_segment_id(seg.seg_id, touched.holds),
            start_pos=seg.start_pos + at,
            parent=int(seg.hashes[at - 1]),
            hashes=seg.hashes[at:].copy(),
            holder_ids=seg.holder_ids.copy(),
            presence=seg.presence[:, at:].copy(),
            meta=None if seg.meta is None else seg.meta[:, at:].copy(),
        )
        seg.hashes = seg.hashes[:at].copy()
        seg.presence = seg.presence[:, :at].copy()
        if seg.meta is not None:
            seg.meta = seg.meta[:, :at].copy()
        touched.add_new(tail)
        touched.cleared(seg.seg_id)  # either side may now have rows holding nothing
        touched.cleared(tail.seg_id)
        w.put_blocks(tail.hashes, tail.seg_id, 0)

    def remove(self, w: WriteTxn, chain: np.ndarray, name: str) -> Plan:
        """Clear holder ``name``'s presence bits for ``chain``; blocks it lacks are skipped."""
        if self._runs_in_c(w):
            return self._one(w, ("remove", chain, name))
        native.ran_python("pack_batch")
        plan, touched = Plan(), Touched(w, self.deaths)
        self.add_remove(w, touched, plan, chain, name)
        touched.flush(plan)
        return plan

    def add_remove(self, w: WriteTxn, touched: Touched, plan: Plan, chain: np.ndarray,
                   name: str) -> None:
        """Clear ``name``'s presence bits for ``chain`` (blocks it lacks are skipped).

        Engines evict a chain's blocks last first, so a remove is mostly runs of
        consecutive blocks, backwards (or forwards): with local lookups each run costs
        one lookup and a compare in its segment, not a lookup per block.
        """
        holder_id = touched.holder_id(name)
        if holder_id is None:
            return
        if WALKING and w.capabilities.local_reads:
            TAKEN["run_remove"] += 1
            self._remove_runs(w, touched, plan, chain, holder_id)
            return
        TAKEN["general_remove"] += 1
        seg_ids, offsets = w.locate(chain)
        for seg_id in np.unique(seg_ids[seg_ids != 0]).tolist():
            seg = touched.get(seg_id)
            rows = np.flatnonzero(seg.holder_ids == holder_id)
            if not rows.size:
                continue
            offs = offsets[seg_ids == seg_id].astype(np.int64)
            plan.removed_blocks += int(seg.presence[rows[0], offs].sum())
            seg.presence[rows[0], offs] = 0
            touched.cleared(seg_id)
            if seg.meta is not None:
                seg.meta[rows[0], offs] = -1

    def _remove_runs(self, w: WriteTxn, touched: Touched, plan: Plan, chain: np.ndarray,
                     holder_id: int) -> None:
        n, i = int(chain.size), 0
        while i < n:
            seg_id, off = w.locate_one(int(chain[i]))
            if not seg_id:
                i += 1
                continue
            seg = touched.get(seg_id)
            rest = chain[i + 1 :]
            k = _common_prefix(seg.hashes[off - 1 :: -1], rest) if off else 0
            if k:
                lo, hi = off - k, off + 1
            else:
                k = _common_prefix(seg.hashes[off + 1 :], rest)
                lo, hi = off, off + k + 1
            i += k + 1
            holders = seg.holder_ids.tolist()
            if holder_id in holders:
                row = holders.index(holder_id)
                plan.removed_blocks += int(np.count_nonzero(seg.presence[row, lo:hi]))
                seg.presence[row, lo:hi] = 0
                if not np.count_nonzero(seg.presence[row]):
                    touched.cleared(seg_id)  # the row holds nothing now: flush drops it
                if seg.meta is not None:
                    seg.meta[row, lo:hi] = -1

    def clear(self, w: WriteTxn, holder_ids: list[int]) -> Plan:
        """Clear every block of ``holder_ids``, visiting only their segments (the filters)."""
        plan, touched = Plan(), Touched(w, self.deaths)
        self._fetch_cleared(touched, holder_ids)
        self.add_clear(touched, plan, holder_ids)
        touched.flush(plan)
        return plan

    def _fetch_cleared(self, touched: Touched, ids) -> None:
        """The committed segments of the holders ``ids`` (their filters), at once."""
        touched.fetch_ahead(sorted({s for h in ids for s in self.memory.filters.segments(h)}))

    def add_clear(self, touched: Touched, plan: Plan, holder_ids: list[int]) -> None:
        for holder_id in holder_ids:
            # Committed segments from the filter, and any this transaction touched
            # (new ones, or ones the holder joined earlier in a batch).
            seg_ids = set(self.memory.filters.segments(holder_id)) | touched.holding(holder_id)
            for seg_id in sorted(seg_ids):
                seg = touched.get(seg_id)
                rows = np.flatnonzero(seg.holder_ids == holder_id)
                if rows.size:
                    plan.removed_blocks += int(seg.presence[rows[0]].sum())
                    seg.presence[rows[0]] = 0
                    touched.cleared(seg_id)


def _ctx(w: WriteTxn, probe: tuple) -> tuple:
    """``pack_batch``'s first argument for a write on ``w``: its callables, the
    directory's probe, and liblmdb's calls when ``w`` has them (counted as a Python
    run of ``lmdb_pack`` when it has not, on LMDB)."""
    raw = w.raw_tables()
    if raw is None and w.capabilities.local_reads:
        native.ran_python("lmdb_pack")
    return (*w.native_calls(), *probe, raw)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading elements ``a`` and ``b`` share."""
    m = min(a.size, b.size)
    if not m or a[0] != b[0]:  # the common answer, without building an array
        return 0
    a, b = a[:m], b[:m]
    if a.tobytes() == b.tobytes():  # cheaper than a compare and a reduction
        return m
    return int((a != b).argmax())


def _looked_up(ops: list[tuple]) -> np.ndarray:
    """The hashes a batch's inserts and removes look up: their blocks, then the parents.

    >>> _looked_up([("insert", np.array([5], np.uint64), 4, "e", None)]).tolist()
    [5, 4]
    """
    parents = [op[2] for op in ops if op[0] == "insert" and op[2] is not None]
    return np.concatenate([*(op[1] for op in ops if op[0] in ("insert", "remove")),
                           np.array(parents, np.uint64)])
