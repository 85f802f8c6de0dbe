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

>>> import numpy as np
>>> is_engine_op(("remove_engine", np.array([1], np.uint64), "w0\\0GPU", 7))
True
"""

from __future__ import annotations

import weakref

import numpy as np

from .errors import ParentNotFoundError
from .store import WriteTxn, alias_keys
from .tokenkeys import token_keys
from .writeset import Plan

ENGINE_KINDS = ("insert_engine", "remove_engine")
SWEEP_PER_BATCH = 512  # stored aliases checked for a dead block per batch
_EMPTY = np.zeros(0, np.uint64)
_sweep_from: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # packer -> cursor


def is_engine_op(op: tuple) -> bool:
    """Does a packer-form operation carry engine hashes to resolve?"""
    return op[0] in ENGINE_KINDS


def pack(w: WriteTxn, packer, ops: list[tuple]) -> tuple[Plan, list[tuple[int, Exception]]]:
    """``packer.batch(w, ops)`` with the engine-hash operations resolved first, and the
    aliases brought up to date after (in the same transaction).

    Cost: one batched ``aliases`` lookup per model root; two xxh3 per block of a store
    with tokens; numpy per removal (no Python per block); one ``aliases`` write per
    stored block; a sweep of ``SWEEP_PER_BATCH`` stored aliases.
    """
    if not any(op[0] in ENGINE_KINDS for op in ops):
        return packer.batch(w, ops)
    table = _Lookup(w, ops)
    made: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # op -> (root, hashes, keys)
    parents: dict[int, int | None] = {}  # op -> its parent's key
    failed: list[tuple[int, Exception]] = []
    for i, op in enumerate(ops):
        if op[0] == "insert_engine":
            keys, parent_key = _store_keys(table, op)
            if keys is None:
                failed.append((i, ParentNotFoundError(
                    f"{op[3].replace(chr(0), '/')}: a store whose parent or blocks are not "
                    "in the index (an event was lost)")))
                continue
            made[i], parents[i] = (op[4], op[1], keys), parent_key
            table.learn(op[4], op[1], keys)
    overlay = _overlay(made.values())
    removals = table.resolve_all(ops, overlay)
    resolved, positions = [], []
    for i, op in enumerate(ops):
        if op[0] == "insert_engine":
            if i not in made:
                continue
            op = ("insert", made[i][2], parents[i], op[3], None)
        elif op[0] == "remove_engine":
            op = ("remove", removals[i], op[2])
        resolved.append(op)
        positions.append(i)
    plan, refused = packer.batch(w, resolved)
    refused_at = {positions[j] for j, _ in refused} & made.keys()
    _put(w, overlay if not refused_at else
         _overlay(m for i, m in made.items() if i not in refused_at))
    _sweep(w, packer)
    failed += [(positions[j], exc) for j, exc in refused]
    failed.sort(key=lambda f: f[0])
    per_op = [0] * len(ops)
    for j, count in enumerate(plan.removed_per_op):
        per_op[positions[j]] = count
    plan.removed_per_op = per_op
    return plan, failed


class _Lookup:
    """The stored aliases the batch may need (one lookup per root), and, one by one,
    the few of its own stores' blocks that a later store names (parents, blocks of
    token-less stores): no Python work per block for the rest."""

    def __init__(self, w: WriteTxn, ops: list[tuple]) -> None:
        wanted: dict[int, list[np.ndarray]] = {}
        named: dict[int, list[np.ndarray]] = {}  # what stores name: parents, token-less
        for op in ops:
            if op[0] == "insert_engine":
                mine = []
                if op[2] is not None:
                    mine.append(np.array([op[2]], np.uint64))
                if not _has_tokens(op[1], op[5], op[6]):
                    mine.append(op[1])
                wanted.setdefault(op[4], []).extend(mine)
                named.setdefault(op[4], []).extend(mine)
            elif op[0] == "remove_engine":
                wanted.setdefault(op[3], []).append(op[1])
        self.stored: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for root, parts in wanted.items():
            hashes = np.unique(np.concatenate(parts)) if parts else _EMPTY
            keys, found = w.aliases(root, hashes)
            self.stored[root] = (hashes[found], keys[found])  # sorted by hash
        self.named = {root: np.unique(np.concatenate(p)) if p else _EMPTY
                      for root, p in named.items()}
        self.recent: dict[tuple[int, int], int] = {}

    def one(self, root: int, engine_hash: int) -> int | None:
        key = self.recent.get((root, engine_hash))
        if key is not None:
            return key
        hashes, keys = self.stored.get(root, (_EMPTY, _EMPTY))
        at = int(np.searchsorted(hashes, np.uint64(engine_hash)))
        return int(keys[at]) if at < hashes.size and int(hashes[at]) == engine_hash else None

    def learn(self, root: int, hashes: np.ndarray, keys: np.ndarray) -> None:
        named = self.named.get(root, _EMPTY)  # sorted
        if named.size:
            hit = named[np.minimum(np.searchsorted(named, hashes), named.size - 1)] == hashes
            if hit.any():
                self.recent.update(zip(((root, h) for h in hashes[hit].tolist()),
                                       keys[hit].tolist(), strict=True))

    def resolve_all(self, ops: list[tuple], overlay: dict) -> dict[int, np.ndarray]:
        """Each removal's keys, resolved per root in one go."""
        by_root: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            if op[0] == "remove_engine":
                by_root.setdefault(op[3], []).append(i)
        out = {}
        for root, which in by_root.items():
            parts = [ops[i][1] for i in which]
            keys, found = self.resolve(root, np.concatenate(parts), overlay)
            ends = np.cumsum([p.size for p in parts])
            for i, k, f in zip(which, np.split(keys, ends[:-1]), np.split(found, ends[:-1]),
                               strict=True):
                out[i] = k[f]
        return out

    def resolve(self, root: int, hashes: np.ndarray, overlay: dict
                ) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, found)`` of engine hashes (stored, or stored by the batch)."""
        keys = np.zeros(hashes.size, np.uint64)
        found = np.zeros(hashes.size, bool)
        for table in (self.stored.get(root), overlay.get(root)):
            if table is None or not table[0].size:
                continue
            at = np.minimum(np.searchsorted(table[0], hashes), table[0].size - 1)
            hit = (table[0][at] == hashes) & ~found
            keys[hit] = table[1][at[hit]]
            found |= hit
        return keys, found


def _store_keys(table: _Lookup, op: tuple) -> tuple[np.ndarray | None, int | None]:
    """A store's keys and its parent's key (None at the root), or ``(None, None)``."""
    _, hashes, parent, _, root, tokens, block_size, lora = op
    parent_key = None
    if parent is not None:
        parent_key = table.one(root, parent)
        if parent_key is None:
            return None, None
    if _has_tokens(hashes, tokens, block_size):
        n = hashes.size
        keys, _ = token_keys(tokens[: n * block_size], block_size,
                             parent=root if parent_key is None else parent_key, lora_name=lora)
    else:
        found = [table.one(root, h) for h in hashes.tolist()]  # few: offload stores
        if any(k is None for k in found):
            return None, None
        keys = np.array(found, np.uint64)
    return keys, parent_key


def _overlay(made) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The batch's own stores, per root, sorted by engine hash (for removals)."""
    parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for root, hashes, keys in made:
        parts.setdefault(root, []).append((hashes, keys))
    out = {}
    for root, pieces in parts.items():
        hashes = np.concatenate([h for h, _ in pieces])
        keys = np.concatenate([k for _, k in pieces])
        order = np.argsort(hashes, kind="stable")
        out[root] = (hashes[order], keys[order])
    return out


def _put(w: WriteTxn, applied: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
    """Write the aliases of the stores applied (:func:`_overlay`'s form): per root
    once, in key order (LMDB fills its pages in order)."""
    for root, (hashes, keys) in applied.items():
        first = np.ones(hashes.size, bool)
        first[1:] = hashes[1:] != hashes[:-1]
        w.alias_put(list(zip(alias_keys(root, hashes[first]), _be(keys[first]), strict=True)))


def _sweep(w: WriteTxn, packer) -> None:
    """Delete a few stored aliases whose block has left the index, going round."""
    items, after = w.alias_scan(_sweep_from.get(packer), SWEEP_PER_BATCH)
    _sweep_from[packer] = after
    if items:
        keys = np.frombuffer(b"".join(v for _, v in items), ">u8").astype(np.uint64)
        dead = np.flatnonzero(w.locate(keys)[0] == 0)
        if dead.size:
            w.alias_delete([items[j][0] for j in dead.tolist()])


def _has_tokens(hashes: np.ndarray, tokens: np.ndarray | None, block_size: int | None) -> bool:
    """Did a store carry the tokens of all its blocks?"""
    return tokens is not None and bool(block_size) and tokens.size >= hashes.size * block_size


def _be(keys: np.ndarray) -> list[bytes]:
    return keys.astype(">u8").view("V8").tolist()
