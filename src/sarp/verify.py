"""The verifier: what a fetched segment proves about the query, vectorised per segment.

Only what this module confirms is ever returned by ``match``: blocks whose hashes
equal the query's at the same positions, held by the holders it names.
"""

from __future__ import annotations

import struct

import numpy as np

from . import native
from .answer import Match, answer_of_rows, plain_answer
from .errors import CorruptRecordError
from .segment import DAMAGE, HASHES_AT, Segment, checked_presence, decode, layout

_HOLDER_ID = struct.Struct("<H")
_FEW_HOLDERS = 8  # up to this many rows, examine_py finds runs row by row (bytes.find)
_HASHES_AT = HASHES_AT


def examine_py(
    seg_id: int, record: bytes, query_bytes: bytes, start: int, parent: int | None
) -> tuple[int, int, list[int], list[int]] | None:
    """Everything one match step needs from a fetched record.

    Checks the record (checksum, layout) and that it sits at query position
    ``start`` right after ``parent`` (the query's previous block, ``None`` at 0), so
    even hashes that are not chained cannot match the wrong place.  Returns
    ``(same, any_run, holder_ids, runs)``: how many leading blocks of the record
    equal the query's (``query_bytes``, little-endian uint64, from block
    ``start`` on), how many of those some holder holds, the record's holder ids,
    and each one's leading run; ``None`` when the record does not continue the
    query there.

    Cost: one xxh3 pass and one memcmp over the record, then one ``bytes.find``
    for a record with one holder (the common case); numpy only when the hashes
    differ in a long record or several holders share it.  No object is built.

    :func:`examine` is this function in C when the extension was built
    (``verify.c``), with this one as the reference and for damaged records.

    >>> rec = Segment(1, 0, None, np.array([5, 6, 7], np.uint64), np.array([4], np.uint16),
    ...               np.array([[1, 1, 0]], np.uint8)).encode()
    >>> examine_py(1, rec, np.array([5, 6, 7], "<u8").tobytes(), 0, None)
    (3, 2, [4], [2])
    >>> examine_py(1, rec, np.array([5, 9], "<u8").tobytes(), 0, None)
    (1, 1, [4], [1])
    >>> examine_py(1, rec, np.array([5], "<u8").tobytes(), 0, 77) is None  # another parent
    True
    >>> examine(1, rec, np.array([5, 6, 7], "<u8").tobytes(), 0, None)  # C or Python alike
    (3, 2, [4], [2])
    """
    _, n, nh, start_pos, rec_parent, holders_at, presence_at, _ = layout(seg_id, record)
    if start_pos != start or rec_parent != parent:
        return None
    m = max(0, min(n, len(query_bytes) // 8 - start))  # 0 past the query's end, as in C
    ours = record[_HASHES_AT : _HASHES_AT + 8 * m]
    theirs = query_bytes[8 * start : 8 * (start + m)]
    same = m if ours == theirs else _equal_prefix(ours, theirs)
    if nh == 1:
        gap = record.find(b"\0", presence_at, presence_at + same)
        run = same if gap < 0 else gap - presence_at
        return same, run, [_HOLDER_ID.unpack_from(record, holders_at)[0]], [run]
    holder_ids = np.frombuffer(record, "<u2", nh, holders_at).tolist()
    if nh <= _FEW_HOLDERS:
        # each row's run is one bytes.find; when some row holds all ``same`` blocks
        # (the holder that stored them, as a rule), so do the rows together
        runs = []
        for at in range(presence_at, presence_at + nh * n, n):
            gap = record.find(b"\0", at, at + same)
            runs.append(same if gap < 0 else gap - at)
        if runs and max(runs) == same:
            return same, same, holder_ids, runs
    presence = np.frombuffer(record, np.uint8, nh * n, presence_at).reshape(nh, n)
    any_run, runs = leading_runs(presence, same)
    return same, any_run, holder_ids, runs


def examine(
    seg_id: int, record: bytes, query_bytes: bytes, start: int, parent: int | None
) -> tuple[int, int, list[int], list[int]] | None:
    """:func:`examine_py` in C (``verify.c``) when :mod:`sarp.native` has it; a damaged
    record is examined again in Python, whose error names the damage."""
    c = native.C
    if c is None:
        native.ran_python("examine")
        return examine_py(seg_id, record, query_bytes, start, parent)
    found = c.examine(record, query_bytes, start, parent or 0, parent is not None)
    if found.__class__ is not int:
        return found
    examine_py(seg_id, record, query_bytes, start, parent)  # raises, naming the damage
    raise CorruptRecordError(f"segment {seg_id}: {DAMAGE.get(found, found)} (found in C, "
                             "not by the Python check: a bug; please report it)")




def _equal_prefix(ours: bytes, theirs: bytes) -> int:
    """Leading uint64s equal in two unequal byte strings of the same length.

    >>> _equal_prefix(np.array([5, 6, 7], "<u8").tobytes(), np.array([5, 6, 9], "<u8").tobytes())
    2
    """
    if len(ours) <= 512:
        # Short: XOR as little-endian ints; the lowest set bit is in the first
        # differing block (cheaper than building numpy arrays for a few blocks).
        diff = int.from_bytes(ours, "little") ^ int.from_bytes(theirs, "little")
        return ((diff & -diff).bit_length() - 1) // 64
    equal = np.frombuffer(ours, "<u8") == np.frombuffer(theirs, "<u8")
    return int(equal.argmin())


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


class PrefixWalk:
    """Per-holder and per-instance prefix bookkeeping across the segments of one match."""

    __slots__ = ("_instance_of", "_with_meta", "total", "going", "_holders", "_instances",
                 "_meta", "_first", "_steps", "_plain", "_took", "_rows")

    def __init__(
        self, instance_of: list[int] | None, with_meta: bool, with_presence: bool = False
    ) -> None:
        self._instance_of = instance_of
        self._with_meta = with_meta
        # (holder ids, presence rows over the step's held run) per step, when asked
        self._steps: list[tuple[list[int], np.ndarray]] | None = [] if with_presence else None
        self.total = 0
        self.going = True
        self._holders: dict[int, list] = {}  # holder id -> [blocks, still extending]
        self._instances: dict[int, list] = {}
        self._meta: dict[int, list[np.ndarray]] = {}
        self._first = True
        # per-holder runs only: no instance grouping, meta or presence to collect
        self._plain = instance_of is None and not with_meta and not with_presence
        self._took = False  # _holders maps holder id -> blocks (take), not [blocks, going]
        self._rows: dict[int, bytes] | None = None  # holder id -> presence (take_rows)

    @property
    def plain(self) -> bool:
        """Per-holder runs only (no instance grouping, meta or presence to collect)."""
        return self._plain

    @property
    def by_rows(self) -> bool:
        """Can a walk's per-holder presence (:meth:`take_rows`) answer it: anything but
        meta."""
        return not self._with_meta

    def take_rows(self, total: int, rows: dict[int, bytes]) -> None:
        """Adopt a whole walk done elsewhere as each holder's presence over the
        ``total`` verified blocks (bytes of 0 and 1): the runs per holder, per
        instance and per tier all follow from it (:meth:`result`)."""
        self.total = total
        self._rows = rows
        self.going = False

    def take(self, total: int, runs: dict[int, int]) -> None:
        """Adopt a whole walk done elsewhere (:data:`native_walk`): the verified prefix
        and each holder's part of it."""
        self.total = total
        self._holders = runs
        self._took = True
        self.going = False

    def step(
        self, seg_id: int, record: bytes, same: int, any_run: int, holder_ids: list[int],
        runs: list[int],
    ) -> int:
        """Account for a record whose first ``same`` blocks equal the query's."""
        # A block nobody holds ends the prefix; a hash mismatch does not (a branch
        # segment may continue the query from there).
        self.going = any_run == same and any_run > 0
        if any_run == 0:
            return 0
        self._extend(self._holders, holder_ids, runs, any_run)
        if self._plain:
            self._first = False
            self.total += any_run
            return any_run
        if self._instance_of is not None:  # some instance holds blocks in several media
            # A holder newer than this walk's names (a Valkey reader's reads are not one
            # snapshot) counts for no instance: the answer knows less, never more.
            known = len(self._instance_of)
            instances = [self._instance_of[h] if h < known else -1 for h in holder_ids]
            if len(set(instances)) == len(instances):
                self._extend(self._instances, instances, runs, any_run)
            else:
                inst_ids, inst_presence = group_rows(
                    checked_presence(record)[:, :any_run], np.array(instances, np.int64)
                )
                _, inst_runs = leading_runs(inst_presence, any_run)
                self._extend(self._instances, inst_ids.tolist(), inst_runs, any_run)
        if self._with_meta:
            self._take_meta(decode(seg_id, record), holder_ids, runs)
        if self._steps is not None:
            rows = checked_presence(record)[:, :any_run].astype(bool)
            self._steps.append((holder_ids, rows))
        self._first = False
        self.total += any_run
        return any_run

    def _extend(self, table: dict[int, list], ids: list[int], runs: list[int], limit: int) -> None:
        """Add each id's run; an id keeps extending only while it holds every block."""
        if self._first:
            for key, run in zip(ids, runs, strict=True):
                table[key] = [run, run == limit]
            return
        single = ids[0] if len(ids) == 1 else None
        runs_by_id = None if single is not None else dict(zip(ids, runs, strict=True))
        for key, state in table.items():
            if state[1]:
                if single is not None:
                    run = runs[0] if key == single else 0
                else:
                    run = runs_by_id.get(key, 0)
                state[0] += run
                state[1] = run == limit

    def _take_meta(self, seg: Segment, holder_ids: list[int], runs: list[int]) -> None:
        for row, holder_id in enumerate(holder_ids):
            state = self._holders.get(holder_id)
            if state is None or (not self._first and holder_id not in self._meta):
                continue
            run = runs[row]
            values = seg.meta[row, :run] if seg.meta is not None else np.full(run, -1, np.int64)
            self._meta.setdefault(holder_id, []).append(values)

    def result(
        self, holder_names: dict[int, tuple[str, str]], instance_names: list[str], reads: int
    ) -> Match:
        # Holder ids without a (verified) name are never reported: see Index._load_holders.
        if self._rows is not None:
            return self._result_of_rows(holder_names, instance_names, reads)
        if self._plain:  # one medium per instance: an instance's prefix is its one holder's
            runs = self._holders if self._took else {h: s[0] for h, s in self._holders.items()}
            return plain_answer(self.total, runs, holder_names, reads)
        if self._instance_of is not None:
            by_holder = {
                instance_names[i]: state[0] for i, state in self._instances.items()
                if state[0] and i >= 0
            }
        else:  # one medium per instance: an instance's prefix is its one holder's
            by_holder = {
                holder_names[h][0]: state[0] for h, state in self._holders.items()
                if state[0] and h in holder_names
            }
        by_medium: dict[str, dict[str, int]] = {}
        meta = {}
        for holder_id, state in self._holders.items():
            if state[0] and holder_id in holder_names:
                instance, medium = holder_names[holder_id]
                by_medium.setdefault(instance, {})[medium] = state[0]
                if self._with_meta:
                    meta[(instance, medium)] = np.concatenate(self._meta[holder_id])[: state[0]]
        presence = {}
        if self._steps is not None:
            # one row per named holder over every verified block, filled step by step
            named = {h for ids, _ in self._steps for h in ids} & holder_names.keys()
            row_of = {h: i for i, h in enumerate(named)}
            table = np.zeros((len(row_of), self.total), bool)
            at = 0
            for ids, rows in self._steps:
                width = rows.shape[1]
                for k, holder_id in enumerate(ids):
                    i = row_of.get(holder_id)
                    if i is not None:
                        table[i, at : at + width] = rows[k]
                at += width
            presence = {holder_names[h]: table[i] for h, i in row_of.items()}
        return Match(self.total, by_holder, by_medium, meta, reads, presence,
                     self._instance_of is not None)

    def _result_of_rows(self, holder_names: dict[int, tuple[str, str]],
                        instance_names: list[str], reads: int) -> Match:
        """:meth:`result` from each holder's presence (:meth:`take_rows`)."""
        return answer_of_rows(self.total, self._rows, holder_names, self._instance_of,
                              instance_names, reads, self._steps is not None)


# -- the walk: one match's steps through the directory and the store ----------------------

_U64_LE = struct.Struct("<Q")
LONG_CHAIN = 256  # blocks: match_many walks longer chains one at a time


def match_one(r, directory, holders, query: np.ndarray, on_damage, *, with_meta: bool = False,
              with_presence: bool = False, prefetched: bool = False) -> Match:
    """The whole of one match on read transaction ``r``: the walk through ``directory``
    and the store, and the answer named by ``holders`` (:class:`sarp.holders.Holders`,
    as caught up).  ``on_damage(exc)``: a damaged record stopped the walk.

    Cost: about matched/S + 1 record reads (see :func:`walk_one`).
    """
    query_bytes = query.astype("<u8", copy=False).tobytes()
    grouping = holders.instance_of if holders.multi_medium else None
    c, get = native.C, r.native_get
    in_c = c is not None and get is not None and not with_meta and (
        prefetched or not r.capabilities.prefetch)
    if in_c:
        # the C walk and its answer, with no PrefixWalk between (walk_in_c's, inlined:
        # a match of a few blocks spent more in the Python around the walk than in it)
        rows = with_presence or grouping is not None
        total, reads, runs, stopped_at = c.walk(get, directory.lookup,
                                                *directory.probe_dicts(), query_bytes, rows)
        if stopped_at != -2:
            r.reads += reads
            if stopped_at >= 0:
                _report_damage(r, stopped_at, on_damage)
            if rows:
                return answer_of_rows(total, runs, holders.names, grouping,
                                      holders.instance_names, r.reads, with_presence)
            return plain_answer(total, runs, holders.names, r.reads)
    walk = PrefixWalk(grouping, with_meta, with_presence)
    walk_one(r, directory, walk, query, query_bytes, on_damage, prefetched=prefetched,
             in_c=not in_c)  # (not again, when C handed this walk back)
    return walk.result(holders.names, holders.instance_names, r.reads)


def match_chains(r, directory, holders, queries: list[np.ndarray], on_damage, *,
                 with_meta: bool = False, with_presence: bool = False,
                 prefetch: bool = False) -> list[Match]:
    """:func:`match_one` for many chains on one read transaction (:func:`walk_many`)."""
    grouping = holders.instance_of if holders.multi_medium else None
    walks = [PrefixWalk(grouping, with_meta, with_presence) for _ in queries]
    reads = walk_many(r, directory, walks, queries, on_damage, prefetch=prefetch)
    return [walk.result(holders.names, holders.instance_names, reads[i])
            for i, walk in enumerate(walks)]


def walks_in_c(r, walk: PrefixWalk) -> bool:
    """Can ``walk`` be done by the C walk (``verify.c``) on ``r``: the extension is
    loaded, the transaction hands C its records (``native_get``: local ones, or a
    remote store's prefetched ones), and no meta is wanted."""
    return native.C is not None and walk.by_rows and r.native_get is not None


def walk_one(r, directory, walk: PrefixWalk, query: np.ndarray, query_bytes: bytes,
             on_damage, *, prefetched: bool = False, in_c: bool = True) -> None:
    """One directory probe and one record read per segment step, verified.

    ``on_damage(exc)``: a damaged record stopped the walk (the prefix verified so far
    stands).  ``prefetched``: the caller fetched this query's predicted records already.
    ``in_c``: try the walk in C first (False: the caller did).

    Cost: about matched/S + 1 record reads; numpy work per segment, none per block.
    """
    if r.capabilities.prefetch and not prefetched:  # remote: one round trip for them all
        r.prefetch(directory.predicted_keys(query))
    if in_c and walks_in_c(r, walk) and walk_in_c(r, directory, walk, query_bytes, on_damage):
        return
    native.ran_python("walk")
    lookup, unpack = directory.lookup, _U64_LE.unpack_from
    pos, parent, size = 0, None, query.size
    while pos < size:
        seg_id = lookup(unpack(query_bytes, 8 * pos)[0])
        if seg_id is None:
            break
        step = advance(r, walk, seg_id, query_bytes, pos, parent, on_damage)
        pos += step
        if not step or not walk.going:
            break
        parent = unpack(query_bytes, 8 * (pos - 1))[0]


def walk_in_c(r, directory, walk: PrefixWalk, query_bytes: bytes, on_damage) -> bool:
    """The whole walk in one C call, on this transaction's reads; False when a segment
    has more holders than C takes (walk it in Python).  The caller checked
    :func:`walks_in_c`."""
    rows = not walk.plain  # instances over media, or presence: each holder's rows
    total, reads, runs, stopped_at = native.C.walk(
        r.native_get, directory.lookup, *directory.probe_dicts(), query_bytes, rows)
    if stopped_at == -2:
        return False
    r.reads += reads
    if rows:
        walk.take_rows(total, runs)
    else:
        walk.take(total, runs)
    if stopped_at >= 0:
        _report_damage(r, stopped_at, on_damage)
    return True


def _report_damage(r, seg_id: int, on_damage) -> None:
    """The C walk stopped at segment ``seg_id``'s damaged record: the Python check
    names the damage to ``on_damage``."""
    try:
        examine_py(seg_id, r.raw_records([seg_id])[0], b"", 0, None)
    except CorruptRecordError as exc:
        on_damage(exc)


def advance(r, walk: PrefixWalk, seg_id: int, query_bytes: bytes, pos: int,
            parent: int | None, on_damage) -> int:
    """Read and verify segment ``seg_id`` at query position ``pos``; return the blocks
    it adds to the walk (0: the match ends here)."""
    record = r.record(seg_id)
    if record is None:
        return 0
    try:
        found = examine(seg_id, record, query_bytes, pos, parent)
    except CorruptRecordError as exc:
        on_damage(exc)
        return 0
    if found is None:
        return 0
    return walk.step(seg_id, record, *found)


def walk_many(r, directory, walks: list[PrefixWalk], queries: list[np.ndarray], on_damage,
              *, prefetch: bool) -> list[int]:
    """Every query's walk, sharing the directory probes: one ``searchsorted`` per
    segment step of all chains still going (or each chain's whole walk in one C call).
    ``prefetch``: fetch every chain's predicted records first (a remote store's
    writer; a reader's read fetched them already).  Returns the reads per chain.
    """
    n = len(queries)
    sizes = [q.size for q in queries]
    reads, pos = [0] * n, [0] * n
    if prefetch and r.capabilities.prefetch:
        everything = np.concatenate(queries)
        if everything.size:
            r.prefetch(directory.predicted_keys(everything))
    # Long chains take match's walk one at a time: their steps are long compares, and
    # the bytes of many of them at once only crowd the cache.
    one_call = walks_in_c(r, walks[0])
    for i in range(n):
        if sizes[i] > LONG_CHAIN or (one_call and sizes[i]):
            before = r.reads
            query_bytes = queries[i].astype("<u8", copy=False).tobytes()
            if not (one_call and walk_in_c(r, directory, walks[i], query_bytes, on_damage)):
                walk_one(r, directory, walks[i], queries[i], query_bytes, on_damage,
                         prefetched=True, in_c=False)
            reads[i] = r.reads - before
    active = [] if one_call else [i for i in range(n) if 0 < sizes[i] <= LONG_CHAIN]
    if active:
        native.ran_python("walk")
    unpack = _U64_LE.unpack_from
    query_bytes = {i: queries[i].astype("<u8", copy=False).tobytes() for i in active}
    while active:
        firsts = np.fromiter((unpack(query_bytes[i], 8 * pos[i])[0] for i in active),
                             np.uint64, len(active))
        going = []
        for i, seg_id in zip(active, directory.lookup_many(firsts).tolist(), strict=True):
            if seg_id < 0:
                continue
            p = pos[i]
            parent = None if p == 0 else unpack(query_bytes[i], 8 * p - 8)[0]
            before = r.reads
            step = advance(r, walks[i], seg_id, query_bytes[i], p, parent, on_damage)
            reads[i] += r.reads - before
            pos[i] = p + step
            if step and walks[i].going and p + step < sizes[i]:
                going.append(i)
        active = going
    return reads
