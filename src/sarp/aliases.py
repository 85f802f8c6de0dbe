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

:func:`pack` resolves them, in order and seeing the batch's own earlier stores, hands
everything to the packer, and then writes the aliases of the stores applied and
deletes those of blocks that left the index.  Aliases are content-addressed (an
engine hash names the same tokens under a root whatever engine sent it), so one left
behind (an engine cleared) can only resolve to its own block: it costs space until a
removal of that hash deletes it, never an answer.

>>> import numpy as np
>>> is_engine_op(("remove_engine", np.array([1], np.uint64), "w0\\0GPU", 7))
True
"""

from __future__ import annotations

import numpy as np

from .errors import ParentNotFoundError
from .store import WriteTxn, alias_keys
from .tokenkeys import token_keys
from .writeset import Plan

ENGINE_KINDS = ("insert_engine", "remove_engine")


def is_engine_op(op: tuple) -> bool:
    """Does a packer-form operation carry engine hashes to resolve?"""
    return op[0] in ENGINE_KINDS


def pack(w: WriteTxn, packer, ops: list[tuple]) -> tuple[Plan, list[tuple[int, Exception]]]:
    """``packer.batch(w, ops)`` with the engine-hash operations resolved first, and the
    aliases brought up to date after (in the same transaction).

    Cost: one batched ``aliases`` lookup per model root for the parents, removals and
    token-less stores; two xxh3 per block of a store with tokens; one ``aliases``
    write per stored block and a ``blocks`` lookup per removed one.
    """
    if not any(op[0] in ENGINE_KINDS for op in ops):
        return packer.batch(w, ops)
    known = _lookup(w, ops)
    resolved, positions, failed = [], [], []
    puts: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # resolved op -> (root, E, K)
    gone: list[tuple[int, np.ndarray, np.ndarray]] = []  # removals: (root, E, K)
    for i, op in enumerate(ops):
        if op[0] == "insert_engine":
            _, hashes, parent, name, root, tokens, block_size, lora = op
            keys, parent_key = _store_keys(known, root, hashes, parent, tokens, block_size,
                                           lora)
            if keys is None:
                failed.append((i, ParentNotFoundError(
                    f"{name.replace(chr(0), '/')}: a store whose parent or blocks are not "
                    "in the index (an event was lost)")))
                continue
            known.update(zip(((root, int(h)) for h in hashes.tolist()), keys.tolist(),
                             strict=True))
            puts[len(resolved)] = (root, hashes, keys)
            op = ("insert", keys, parent_key, name, None)
        elif op[0] == "remove_engine":
            _, hashes, name, root = op
            keys = [known.get((root, h)) for h in hashes.tolist()]
            hit = np.array([k is not None for k in keys], bool)
            found = np.array([k for k in keys if k is not None], np.uint64)
            gone.append((root, hashes[hit], found))
            op = ("remove", found, name)
        resolved.append(op)
        positions.append(i)
    plan, refused = packer.batch(w, resolved)
    applied = set(range(len(resolved))) - {j for j, _ in refused}
    for j in sorted(applied & puts.keys()):
        root, hashes, keys = puts[j]
        w.alias_put(list(zip(alias_keys(root, hashes), _be(keys), strict=True)))
    for root, hashes, keys in gone:
        if keys.size:
            dead = w.locate(keys)[0] == 0
            if dead.any():
                w.alias_delete(alias_keys(root, hashes[dead]))
    failed += [(positions[j], exc) for j, exc in refused]
    failed.sort(key=lambda f: f[0])
    per_op = [0] * len(ops)
    for j, count in enumerate(plan.removed_per_op):
        per_op[positions[j]] = count
    plan.removed_per_op = per_op
    return plan, failed


def _lookup(w: WriteTxn, ops: list[tuple]) -> dict[tuple[int, int], int]:
    """The stored aliases of every engine hash the batch may need, per root at once."""
    wanted: dict[int, list[np.ndarray]] = {}
    for op in ops:
        if op[0] == "insert_engine":
            if op[2] is not None:
                wanted.setdefault(op[4], []).append(np.array([op[2]], np.uint64))
            if not _has_tokens(op[1], op[5], op[6]):
                wanted.setdefault(op[4], []).append(op[1])
        elif op[0] == "remove_engine":
            wanted.setdefault(op[3], []).append(op[1])
    known: dict[tuple[int, int], int] = {}
    for root, parts in wanted.items():
        hashes = np.unique(np.concatenate(parts))
        keys, found = w.aliases(root, hashes)
        known.update(zip(((root, h) for h in hashes[found].tolist()), keys[found].tolist(),
                         strict=True))
    return known


def _store_keys(known: dict, root: int, hashes: np.ndarray, parent: int | None,
                tokens: np.ndarray | None, block_size: int | None, lora: str | None
                ) -> tuple[np.ndarray | None, int | None]:
    """A store's keys and its parent's key (None at the root), or ``(None, None)``."""
    parent_key = None
    if parent is not None:
        parent_key = known.get((root, parent))
        if parent_key is None:
            return None, None
    n = hashes.size
    if _has_tokens(hashes, tokens, block_size):
        keys, _ = token_keys(tokens[: n * block_size], block_size,
                             parent=root if parent_key is None else parent_key, lora_name=lora)
        return keys, parent_key
    keys = [known.get((root, h)) for h in hashes.tolist()]
    if any(k is None for k in keys):
        return None, None
    return np.array(keys, np.uint64), parent_key


def _has_tokens(hashes: np.ndarray, tokens: np.ndarray | None, block_size: int | None) -> bool:
    """Did a store carry the tokens of all its blocks?"""
    return tokens is not None and bool(block_size) and tokens.size >= hashes.size * block_size


def _be(keys: np.ndarray) -> list[bytes]:
    return keys.astype(">u8").view("V8").tolist()
