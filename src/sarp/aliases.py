"""Engine hashes resolved to token keys, inside a batch's write transaction.

An engine whose blocks are keyed by their tokens (:mod:`sarp.tokenkeys`) still names
its blocks by its own hashes: a store names its parent by one, and a removal names
only those.  The ``aliases`` table (:mod:`sarp.store`) keeps, per model root, each
engine hash's token key.  Two operations of the packer's form carry engine hashes:

* ``("insert_engine", hashes, parent, name, root, tokens, block_size, lora_name)``: a
  store.  With its tokens, its keys are made from them, chained on the parent's key
  (the parent resolved through the aliases; no parent: the model root); without (an
  offload store, say), its blocks are resolved through the aliases, and it is applied
  only when all of them are.  A parent that resolves to nothing refuses it
  (``ParentNotFoundError``, as when the engine's parent is not held).
* ``("remove_engine", hashes, name, root)``: a removal of the blocks the hashes
  resolve to (the others are not in the index).

An engine's hash names its block's whole prefix (engines chain their hashes), so an
alias is a function of its engine hash: the same whoever wrote it and whenever, and
a batch's removals resolve against the aliases stored and every store of the batch
alike.  :func:`pack` resolves the operations, hands them to the packer, writes the
aliases of the stores applied, and sweeps a few stored aliases whose block has left
the index (an alias left behind costs space, never an answer: it can only resolve
to its own block).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import numpy as np

from . import native
from .errors import ParentNotFoundError
from .store import WriteTxn
from .tokenkeys import chain_locals, lora_seed, token_keys
from .writeset import Plan

ENGINE_KINDS = ("insert_engine", "remove_engine")
SWEEP_PER_BATCH = 512  # stored aliases checked for a dead block per batch, at most,
SWEEP_PER_BLOCK = 2  # ... two per block the batch names (so it outruns the puts),
SWEEP_MIN = 32  # ... and never fewer in one go;
SWEEP_DEAD_SHARE = 0.25  # ... at that pace while this share of those checked is dead,
SWEEP_SLOWEST = 1 / 16  # ... slower in proportion when fewer are, down to this part
SWEEP_MEMORY = 2048  # ... (a share that falls is followed over about this many checked)
_EMPTY = np.zeros(0, np.uint64)
DEATH_MAP = 1 << 20  # bytes of each map of deaths (see _Pace)
_MASK = np.uint64(DEATH_MAP - 1)


class _Pace:
    """Where one packer's sweep goes on from, how fast it goes, and which of the aliases
    it meets it looks up (see :func:`_sweep`).

    The blocks that left the index lately are marked in two byte maps indexed by the
    low bits of their hash (keys are xxh3 hashes: evenly spread), this round's and the
    last's: an alias whose key's mark is set is looked up, a lookup decides, and a mark
    set by another block only costs a lookup.  Fixed memory (``DEATH_MAP`` bytes each)
    whatever the churn: past about a million deaths a round most marks are set and the
    sweep looks most aliases up, as it did before it had the maps.
    """

    __slots__ = ("after", "credit", "dead_share", "whole", "fresh", "older")

    def __init__(self) -> None:
        self.after: object = None  # the store's cursor the next sweep starts from
        self.credit = 0.0  # aliases the sweep may check now
        self.dead_share = SWEEP_DEAD_SHARE  # of those checked lately, the dead ones
        # every alias met is looked up until a round from the table's start ends: the
        # blocks that left the index before this packer's first write are not known
        self.whole = True
        self.fresh = np.zeros(DEATH_MAP, np.uint8)  # marks of this round's deaths
        self.older = np.zeros(DEATH_MAP, np.uint8)  # ... and of the last round's

    def died(self, hashes: np.ndarray, lost: bool) -> None:
        """Mark blocks that left the index; ``lost``: some were not noted, so the
        sweep looks up every alias again, from the table's start, for a round."""
        if lost:
            self.whole, self.after = True, None
        if hashes.size:
            self.fresh[(hashes & _MASK).astype(np.intp)] = 1

    def suspects(self, keys: np.ndarray) -> np.ndarray:
        """Which of ``keys`` (the aliases met) to look up: those marked in this round
        or the last, or all of them while a round is whole."""
        if self.whole:
            return np.ones(keys.size, bool)
        at = (keys & _MASK).astype(np.intp)
        return (self.fresh[at] | self.older[at]).view(bool)

    def round_ended(self) -> None:
        """The scan reached the table's end: every alias met since its start was looked
        up or had its block marked, so the last round's marks are done with."""
        self.whole = False
        self.older, self.fresh = self.fresh, self.older
        self.fresh.fill(0)


_paces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # packer -> _Pace


def pack(w: WriteTxn, packer, ops: list[tuple]) -> tuple[Plan, list[tuple[int, Exception]]]:
    """``packer.batch(w, ops)`` with the engine-hash operations resolved first, and the
    aliases brought up to date after (in the same transaction).

    Cost: two batched ``aliases`` lookups per model root (parents and token-less
    stores; then the removals no store of the batch made; one on a remote store, a
    round trip); two xxh3 per block of a store
    with tokens (in C); a few numpy calls per store and per batch, no Python per
    block; one ``alias_put`` of the aliases new to the batch (not read, nor made by
    an earlier store: on LMDB a hash probe each and one journal record); a sweep of
    stored aliases, up to two per block of
    the batch (:func:`_sweep`: fewer while few of those it checks are dead).
    """
    if not any(op[0] in ENGINE_KINDS for op in ops):
        return packer.batch(w, ops)
    _pace_of(w, packer)
    if native.C is not None:
        resolved, positions, failed, put = _in_c(w, ops)
    else:
        native.ran_python("resolve_aliases")
        resolved, positions, failed, put = _in_python(w, ops)
    plan, refused = packer.batch(w, resolved)
    put({positions[j] for j, _ in refused})
    _sweep(w, packer, sum(len(op[1]) for op in ops))
    failed += [(positions[j], exc) for j, exc in refused]
    failed.sort(key=lambda f: f[0])
    per_op = [0] * len(ops)
    for j, count in enumerate(plan.removed_per_op):
        per_op[positions[j]] = count
    plan.removed_per_op = per_op
    return plan, failed


def _orphan(op: tuple) -> ParentNotFoundError:
    return ParentNotFoundError(f"{op[3].replace(chr(0), '/')}: a store whose parent or blocks "
                               "are not in the index (an event was lost)")


def _in_python(w: WriteTxn, ops: list[tuple]):
    """The reference of :func:`_in_c`: the operations resolved (``resolved``, at
    ``positions`` of ``ops``), the stores refused, and the aliases' writer."""
    batch = _Batch(w, ops)
    failed = [(i, _orphan(ops[i])) for i in batch.stores if not batch.make(i)]
    removals = batch.removals()
    resolved, positions = [], []
    for i, op in enumerate(ops):
        if op[0] == "insert_engine":
            if i not in batch.keys:
                continue
            op = ("insert", batch.keys[i], batch.parent_keys[i], op[3], None)
        elif op[0] == "remove_engine":
            op = ("remove", removals[i], op[2])
        resolved.append(op)
        positions.append(i)
    return resolved, positions, failed, batch.put


def _in_c(w: WriteTxn, ops: list[tuple]):
    """:func:`_in_python` with the resolution in one C call (``resolve_aliases``,
    ``tokenkeys.c``): per operation a few list items and numpy calls per batch, no
    Python per block."""
    engine = [i for i, op in enumerate(ops) if op[0] in ENGINE_KINDS]
    eops = [ops[i] for i in engine]
    is_store = np.array([op[0] == "insert_engine" for op in eops], bool)
    roots = np.array([op[4] if s else op[3] for op, s in zip(eops, is_store, strict=True)],
                     np.uint64)
    parts = [op[1] for op in eops]
    sizes = np.array([p.size for p in parts], np.int64)
    hashes = np.ascontiguousarray(np.concatenate(parts), np.uint64)
    has_parent = np.array([s and op[2] is not None for op, s in zip(eops, is_store,
                                                                    strict=True)], bool)
    parents = np.array([op[2] if p else 0 for op, p in zip(eops, has_parent, strict=True)],
                       np.uint64)
    tokened = [bool(s) and _has_tokens(op[1], op[5], op[6])
               for op, s in zip(eops, is_store, strict=True)]
    token_counts = np.array([op[1].size * op[6] if t else 0 for op, t in
                             zip(eops, tokened, strict=True)], np.int64)
    block_sizes = np.array([op[6] if t else 0 for op, t in zip(eops, tokened, strict=True)],
                           np.int64)
    seeds = np.array([lora_seed(op[7]) if t else 0 for op, t in zip(eops, tokened,
                                                                   strict=True)], np.uint64)
    tokens = [np.ascontiguousarray(op[5][: op[1].size * op[6]], np.uint32)
              for op, t in zip(eops, tokened, strict=True) if t]
    tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.uint32)
    keys, found, made, parent_keys, first = _resolve(w, is_store, roots, sizes, hashes,
                                                     parents, has_parent, tokens,
                                                     token_counts, block_sizes, seeds)
    parent_keys = parent_keys.tolist()
    ends = np.cumsum(sizes).tolist()
    failed: list[tuple[int, Exception]] = []
    resolved, positions = [], []
    at = {i: j for j, i in enumerate(engine)}
    for i, op in enumerate(ops):
        j = at.get(i)
        if j is not None:
            part = slice(ends[j] - int(sizes[j]), ends[j])
            if not is_store[j]:
                op = ("remove", keys[part][found[part]], op[2])
            elif not made[j]:
                failed.append((i, _orphan(op)))
                continue
            else:
                op = ("insert", keys[part], parent_keys[j] if has_parent[j] else None, op[3],
                      None)
        resolved.append(op)
        positions.append(i)

    def put(refused: set[int]) -> None:
        """Write the aliases of the stores applied (:func:`_written`)."""
        refused_here = np.zeros(is_store.size, bool)
        refused_here[[at[i] for i in refused if i in at]] = True
        blocks = _written(first, made & is_store, sizes, refused_here)
        _put(w, np.repeat(roots, sizes)[blocks], hashes[blocks], keys[blocks])

    return resolved, positions, failed, put


def _resolve(w: WriteTxn, is_store, roots, sizes, hashes, parents, has_parent, tokens,
             token_counts, block_sizes, seeds, given_locals: bool = False):
    """``resolve_aliases`` of operations given as columns, with the stored aliases they
    may need (parents, blocks without tokens) read first, and then those of the
    removals the batch's own stores did not resolve: ``(keys, found, made,
    parent_keys, first)`` as arrays (``first``: the blocks whose alias is new, neither
    read nor made by an earlier store of the batch).  ``given_locals``: ``tokens`` are
    the blocks' local hashes (the columns').

    A removal mostly names blocks a store of the same batch made, whose alias is the
    one stored (a function of its hash), so on a local store only the rest are read.
    """
    # (a remote store reads the removals' aliases in the same round trip, as before)
    local = w.capabilities.local_reads
    need = np.repeat((is_store | (not local)) & (token_counts == 0), sizes)
    stored = _read(w, np.concatenate([np.repeat(roots, sizes)[need], roots[has_parent]]),
                   np.concatenate([hashes[need], parents[has_parent]]))
    keys, found, made, parent_keys, first = native.C.resolve_aliases(
        is_store.astype(np.uint8) ^ 1, roots, sizes, hashes, parents,
        has_parent.astype(np.uint8), tokens, token_counts, block_sizes, seeds, *stored,
        given_locals)
    keys, found = np.frombuffer(keys, np.uint64), np.frombuffer(found, bool)
    left = np.flatnonzero(np.repeat(~is_store, sizes) & ~found)  # removals unresolved
    if left.size and local:
        keys, found = keys.copy(), found.copy()
        left_roots = np.repeat(roots, sizes)[left]
        for root in _distinct(left_roots).tolist():
            mine = left[left_roots == np.uint64(root)]
            keys[mine], found[mine] = w.alias_get(root, hashes[mine])
    return (keys, found, np.frombuffer(made, bool), np.frombuffer(parent_keys, np.uint64),
            np.frombuffer(first, bool))


def release() -> int:
    """Hand back the table ``resolve_aliases`` keeps from batch to batch (in C; the
    next batch maps it again); its bytes.  serve calls it once idle.  Cost: an munmap.

    >>> release() >= 0
    True
    """
    c = native.C
    if c is None:
        native.ran_python("resolve_aliases")
        return 0  # (the reference keeps nothing between batches)
    return c.resolve_aliases_release()


def _read(w: WriteTxn, roots: np.ndarray, hashes: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stored aliases of ``(roots, hashes)`` (each pair read once): their roots,
    hashes and keys."""
    s_roots, s_hashes, s_keys = [_EMPTY], [_EMPTY], [_EMPTY]
    for root in _distinct(roots).tolist():
        asked = _distinct(hashes[roots == np.uint64(root)])
        keys, found = w.alias_get(root, asked)
        s_roots.append(np.full(int(found.sum()), root, np.uint64))
        s_hashes.append(asked[found])
        s_keys.append(keys[found])
    return np.concatenate(s_roots), np.concatenate(s_hashes), np.concatenate(s_keys)


def _written(first: np.ndarray, applied: np.ndarray, sizes: np.ndarray,
             refused: np.ndarray) -> np.ndarray:
    """The blocks (aligned with the hashes) whose aliases a batch writes, given its
    stores ``applied`` by ``resolve_aliases`` and ``refused`` by the packer after: the
    ones new to it (``first``), since an alias read from the index is there with the
    same key already (a function of its hash); or, when the packer refused a store,
    which may have been a hash's first, every store's applied."""
    if not (applied & refused).any():
        return first
    return np.repeat(applied & ~refused, sizes)


def _put(w: WriteTxn, r: np.ndarray, h: np.ndarray, k: np.ndarray) -> None:
    """Write the aliases (root ``r``, engine hash ``h``) -> key ``k`` of the stores
    applied, the first store's key for a hash twice: reversed, since of two puts of one
    alias the later wins (no sort)."""
    w.alias_put(r[::-1].copy(), h[::-1].copy(), k[::-1].copy())


def pack_columns(w: WriteTxn, packer, cols) -> tuple[Plan, list[tuple[int, Exception]]]:
    """:func:`pack` of a commit's columns (:class:`sarp.serving.columns.Taken`): the
    rows keyed by tokens resolved in one ``resolve_aliases`` call, the packer fed the
    columns (``Packer.batch_columns``), the aliases of the stores applied written;
    ``plan.removed_per_op`` per row, as an array.

    Cost: as :func:`pack`, with numpy calls per commit and none per row.
    """
    n = cols.kind.size
    is_store = cols.kind == 0
    eng = cols.root != 0
    keys, made, parent_keys = cols.hashes, np.ones(n, bool), cols.parent
    has_parent = is_store & (cols.has_parent != 0)
    kept_blocks = np.ones(cols.hashes.size, bool)
    if eng.any():
        _pace_of(w, packer)
        if native.C is None:
            native.ran_python("resolve_aliases")
            return _columns_in_python(w, packer, cols)
        in_eng = np.repeat(eng, cols.size)
        k, found, m, pk, first = _resolve(
            w, is_store[eng], cols.root[eng], cols.size[eng], cols.hashes[in_eng],
            cols.parent[eng], has_parent[eng], cols.locals, cols.token_count[eng],
            cols.block_size[eng], cols.seed[eng], given_locals=True)
        keys, parent_keys = cols.hashes.copy(), cols.parent.copy()
        keys[in_eng] = k
        parent_keys[eng] = pk
        made[eng] = m | ~is_store[eng]
        kept_blocks[in_eng] = found | np.repeat(is_store[eng], cols.size[eng])
    failed: list[tuple[int, Exception]] = [
        (i, ParentNotFoundError(f"{cols.names[cols.name[i]].replace(chr(0), '/')}: a store "
                                "whose parent or blocks are not in the index (an event was "
                                "lost)"))
        for i in np.flatnonzero(~made).tolist()]
    rows = np.repeat(np.arange(n), cols.size)
    kept_blocks &= np.repeat(made, cols.size)
    sizes = np.bincount(rows[kept_blocks], minlength=n)[made]
    positions = np.flatnonzero(made)
    plan, refused = packer.batch_columns(
        w, cols.kind[made], sizes.astype(np.int64), keys[kept_blocks], parent_keys[made],
        has_parent[made].astype(np.uint8), cols.name[made], cols.names)
    if (eng & is_store & made).any():
        refused_rows = np.zeros(n, bool)
        refused_rows[positions[[j for j, _ in refused]]] = True
        blocks = np.zeros(cols.hashes.size, bool)
        blocks[in_eng] = _written(first, (is_store & made)[eng], cols.size[eng],
                                  refused_rows[eng])
        _put(w, np.repeat(cols.root, cols.size)[blocks], cols.hashes[blocks], keys[blocks])
    if eng.any():
        _sweep(w, packer, int(cols.hashes.size))
    failed += [(int(positions[j]), exc) for j, exc in refused]
    failed.sort(key=lambda f: f[0])
    per_op = np.zeros(n, np.int64)
    per_op[positions] = plan.removed_per_op
    plan.removed_per_op = per_op
    return plan, failed


def _columns_in_python(w: WriteTxn, packer, cols):
    """:func:`pack_columns` without the extension: the rows as operations, through
    :func:`pack`."""
    ops, starts = [], cols.starts.tolist()
    tokened = np.where(cols.token_count != 0, cols.size, 0)
    local_starts = (np.cumsum(tokened) - tokened).tolist()
    for i in range(cols.kind.size):
        chain = cols.hashes[starts[i] : starts[i] + int(cols.size[i])]
        name, root = cols.names[int(cols.name[i])], int(cols.root[i])
        parent = int(cols.parent[i]) if cols.has_parent[i] else None
        if cols.kind[i] == 1:
            ops.append(("remove", chain, name) if not root else
                       ("remove_engine", chain, name, root))
        elif not root:
            ops.append(("insert", chain, parent, name, None))
        else:
            t, at = int(tokened[i]), local_starts[i]
            ops.append(("insert_engine", chain, parent, name, root,
                        Locals(cols.locals[at : at + t]) if t else None,
                        int(cols.block_size[i]) or None, cols.loras.get(int(cols.seed[i]))))
    plan, failed = pack(w, packer, ops)
    plan.removed_per_op = np.asarray(plan.removed_per_op, np.int64)
    return plan, failed


class _Batch:
    """One batch's engine hashes: the aliases stored (one lookup per root), and the
    batch's own stores as one sorted table (hash -> the first store that holds it and
    where), so that a store's parent or a removal resolves with numpy alone."""

    def __init__(self, w: WriteTxn, ops: list[tuple]) -> None:
        self.w, self.ops = w, ops
        self.stores = [i for i, op in enumerate(ops) if op[0] == "insert_engine"]
        self.keys: dict[int, np.ndarray] = {}  # store -> its keys
        self.parent_keys: dict[int, int | None] = {}
        wanted: dict[int, list[np.ndarray]] = {}
        for op in ops:
            if op[0] == "insert_engine":
                if op[2] is not None:
                    wanted.setdefault(op[4], []).append(np.array([op[2]], np.uint64))
                if not _has_tokens(op[1], op[5], op[6]):
                    wanted.setdefault(op[4], []).append(op[1])
            elif op[0] == "remove_engine":
                wanted.setdefault(op[3], []).append(op[1])
        self.stored = {root: _found(w, root, np.unique(np.concatenate(parts)))
                       for root, parts in wanted.items()}
        # the batch's stores: every block's hash, its store and its place, sorted by
        # (root, hash, store) so that the first hit is the earliest store holding it
        hashes = [ops[i][1] for i in self.stores]
        sizes = np.array([h.size for h in hashes], np.int64)
        self.hash = np.concatenate(hashes) if hashes else _EMPTY
        self.owner = np.repeat(np.arange(len(self.stores)), sizes)
        self.place = np.arange(self.hash.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        self.sizes = sizes
        store_roots = np.array([ops[i][4] for i in self.stores], np.uint64)
        roots = np.repeat(store_roots, sizes)
        # stable: a hash twice keeps its stores' order (the store number grows along)
        self.order = (np.argsort(self.hash, kind="stable") if np.unique(store_roots).size < 2
                      else np.lexsort((self.owner, self.hash, roots)))
        self.sorted_root, self.sorted_hash = roots[self.order], self.hash[self.order]
        self.span = {}  # root -> its slice of the sorted table
        for root in np.unique(store_roots).tolist():
            lo = int(np.searchsorted(self.sorted_root, np.uint64(root), "left"))
            self.span[root] = (lo, int(np.searchsorted(self.sorted_root, np.uint64(root),
                                                       "right")))
        self.index = {i: n for n, i in enumerate(self.stores)}
        self._made_cache: dict[frozenset, tuple] = {}

    def _stored(self, root: int, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, found)`` of ``hashes`` among the stored aliases."""
        got, keys = self.stored.get(root, (_EMPTY, _EMPTY))
        return _search(got, keys, hashes)

    def _earlier(self, root: int, hashes: np.ndarray, before: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, found)`` of ``hashes`` among the keys of the batch's stores made
        before store number ``before``."""
        keys = np.zeros(hashes.size, np.uint64)
        lo, hi = self.span.get(root, (0, 0))
        if hi == lo:
            return keys, np.zeros(hashes.size, bool)
        at = np.minimum(lo + np.searchsorted(self.sorted_hash[lo:hi], hashes), hi - 1)
        row = self.order[at]
        found = (self.sorted_hash[at] == hashes) & (self.owner[row] < before)
        for r in np.flatnonzero(found).tolist():  # few: parents and token-less blocks
            made = self.keys.get(self.stores[int(self.owner[row[r]])])
            if made is None:
                found[r] = False
            else:
                keys[r] = made[int(self.place[row[r]])]
        return keys, found

    def _resolve(self, root: int, hashes: np.ndarray, before: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        keys, found = self._stored(root, hashes)
        if not found.all():
            more, also = self._earlier(root, hashes, before)
            keys = np.where(found, keys, more)
            found |= also
        return keys, found

    def make(self, i: int) -> bool:
        """Store ``i``'s keys, or False when its parent or blocks do not resolve."""
        _, hashes, parent, _, root, tokens, block_size, lora = self.ops[i]
        n = self.index[i]
        parent_key = None
        if parent is not None:
            key, found = self._resolve(root, np.array([parent], np.uint64), n)
            if not found[0]:
                return False
            parent_key = int(key[0])
        chain = root if parent_key is None else parent_key
        if type(tokens) is Locals and _has_tokens(hashes, tokens, block_size):
            keys = chain_locals(tokens.hashes[: hashes.size], parent=chain)
        elif _has_tokens(hashes, tokens, block_size):
            keys, _ = token_keys(tokens[: hashes.size * block_size], block_size,
                                 parent=chain, lora_name=lora)
        else:
            keys, found = self._resolve(root, hashes, n)
            if not found.all():
                return False
        self.keys[i], self.parent_keys[i] = keys, parent_key
        return True

    def _made(self, skip: set[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batch's stores that were made (and not in ``skip``), sorted: roots,
        hashes, keys (the first store's key for a hash twice).  From the table sorted
        at the start: no sort here."""
        key = frozenset(skip & set(self.keys))
        if key in self._made_cache:
            return self._made_cache[key]
        valid = np.array([i in self.keys and i not in skip for i in self.stores], bool)
        if not valid.any():
            return _EMPTY, _EMPTY, _EMPTY
        keys = np.concatenate([self.keys[i] if i in self.keys
                               else np.zeros(self.ops[i][1].size, np.uint64)
                               for i in self.stores])
        keep = np.repeat(valid, self.sizes)[self.order]
        roots, hashes = self.sorted_root[keep], self.sorted_hash[keep]
        made = keys[self.order][keep]
        first = np.ones(hashes.size, bool)
        first[1:] = (hashes[1:] != hashes[:-1]) | (roots[1:] != roots[:-1])
        out = self._made_cache[key] = (roots[first], hashes[first], made[first])
        return out

    def removals(self) -> dict[int, np.ndarray]:
        """Each removal's keys (stored aliases, or any store of the batch), in its
        order; per root in one go."""
        roots, hashes, keys = self._made(set())
        by_root: dict[int, list[int]] = {}
        for i, op in enumerate(self.ops):
            if op[0] == "remove_engine":
                by_root.setdefault(op[3], []).append(i)
        out = {}
        for root, which in by_root.items():
            parts = [self.ops[i][1] for i in which]
            asked = np.concatenate(parts)
            got, found = self._stored(root, asked)
            mine = roots == np.uint64(root)
            more, also = _search(hashes[mine], keys[mine], asked)
            got, found = np.where(found, got, more), found | also
            ends = np.cumsum([p.size for p in parts])[:-1]
            for i, k, f in zip(which, np.split(got, ends), np.split(found, ends), strict=True):
                out[i] = k[f]
        return out

    def put(self, refused: set[int]) -> None:
        """Write the aliases of the stores applied (:func:`_put`)."""
        _put(self.w, *self._made(refused))


def _found(w: WriteTxn, root: int, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(hashes, keys)`` of those of ``hashes`` with an alias under ``root``."""
    keys, found = w.alias_get(root, hashes)
    return hashes[found], keys[found]


def _search(table_hashes: np.ndarray, table_keys: np.ndarray, hashes: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, found)`` of ``hashes`` in a sorted (hash -> key) table."""
    if not table_hashes.size:
        return np.zeros(hashes.size, np.uint64), np.zeros(hashes.size, bool)
    at = np.minimum(np.searchsorted(table_hashes, hashes), table_hashes.size - 1)
    found = table_hashes[at] == hashes
    return np.where(found, table_keys[at], np.uint64(0)), found


def _sweep(w: WriteTxn, packer, blocks: int) -> None:
    """Delete a few stored aliases whose block has left the index, going round the
    table: two per block of the batch, within ``[SWEEP_MIN, SWEEP_PER_BATCH]``, while
    at least ``SWEEP_DEAD_SHARE`` of those checked lately were dead; in proportion
    fewer when fewer were (down to ``SWEEP_SLOWEST`` of that), gathered over commits
    into checks of at least ``SWEEP_MIN``.  A share that rises is taken at once (a
    cleared engine's aliases, dead together), one that falls over about
    ``SWEEP_MEMORY`` checks.

    While the index grows, about 1% of the aliases checked were dead (the Mooncake
    stream keyed by tokens), and the checks (a ``blocks`` lookup each) were a quarter
    of a small commit's time.  Paced so, a sweep that checks c aliases per block named
    finds d dead ones per block in a table whose dead share s settles where
    ``c * s = d``: at most ``SWEEP_DEAD_SHARE`` dead while d <= 0.5, and the full pace
    beyond, as before.  Of the aliases it meets, only those whose block the packer
    deleted this round or the last are looked up (:class:`_Pace`): 1,346 lookups where
    it made 57,856 on that stream, finding the same 1,327 dead.
    """
    pace = _pace_of(w, packer)
    pace.died(*packer.deaths.take())
    part = min(1.0, max(SWEEP_SLOWEST, pace.dead_share / SWEEP_DEAD_SHARE))
    pace.credit = min(pace.credit + part * max(SWEEP_MIN, SWEEP_PER_BLOCK * blocks),
                      SWEEP_PER_BATCH)
    if pace.credit < SWEEP_MIN:
        return
    count = int(pace.credit)
    pace.credit -= count
    roots, hashes, keys, pace.after = w.alias_scan(pace.after, count)
    if keys.size:
        suspect = np.flatnonzero(pace.suspects(keys))
        # engines hashing with other seeds alias one key twice (locate wants it once)
        unique, back = np.unique(keys[suspect], return_inverse=True)
        dead = suspect[w.locate(unique)[0][back] == 0] if unique.size else suspect
        share = dead.size / keys.size
        if share >= pace.dead_share:  # more dead than lately: back to that pace at once
            pace.dead_share = share
        else:  # fewer: slower, as the checks that found them add up
            pace.dead_share += min(1.0, keys.size / SWEEP_MEMORY) * (share - pace.dead_share)
        if dead.size:
            w.alias_delete(roots[dead], hashes[dead])
    if pace.after is None:
        pace.round_ended()


def sweep_bytes(packer) -> int:
    """What the sweep keeps for ``packer``: its maps of deaths (none before the first
    write that names aliases), and the deaths noted since it last ran."""
    pace = _paces.get(packer)
    return packer.deaths.nbytes + (0 if pace is None else pace.fresh.nbytes + pace.older.nbytes)


def _pace_of(w: WriteTxn, packer) -> _Pace:
    """The sweep's state for ``packer``, made before its first write that names aliases
    (a whole round looks every alias up first, unless the table is empty then: the
    deaths of every alias put since are noted)."""
    pace = _paces.get(packer)
    if pace is None:
        pace = _paces[packer] = _Pace()
        pace.whole = bool(w.alias_scan(None, 1)[2].size)
    return pace


def _distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values: a sort and a compare (``np.unique`` hashes, and imports
    ``numpy.ma`` at its first call, 35 ms of a restarted serve's first batch).

    >>> _distinct(np.array([3, 1, 3], np.uint64)).tolist()
    [1, 3]
    """
    values = np.sort(values)
    keep = np.empty(values.size, bool)
    keep[:1] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


class Locals(NamedTuple):
    """A store's blocks by their local hashes (the columns' decoder hashed the tokens)."""
    hashes: np.ndarray


def _has_tokens(hashes: np.ndarray, tokens: np.ndarray | Locals | None,
                block_size: int | None) -> bool:
    """Did a store carry the tokens of all its blocks?"""
    if type(tokens) is Locals:
        return tokens.hashes.size >= hashes.size
    return tokens is not None and bool(block_size) and tokens.size >= hashes.size * block_size
