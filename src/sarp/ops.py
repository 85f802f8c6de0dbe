"""Write operations checked: what callers pass to ``insert``, ``remove``, ``clear`` and
a batch, turned into the packer's form (``("insert", chain, parent, name, meta)``,
``("remove", chain, name)``, ``("clear", instance, medium_or_None)``), or a ValueError
that names the value and the fix.  Nothing here touches the store.

>>> op = prepare(("insert", [1, 2], None, "w0", "GPU"))
>>> op[0], op[1].tolist(), op[3]
('insert', [1, 2], 'w0\\x00GPU')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .hashing import HashesLike, as_hash, as_hashes, repeats
from .holders import DEFAULT_MEDIUM, check_instance, holder_name


def prepare(op: tuple) -> tuple:
    """Check one batch operation's arguments; return the packer's form of it."""
    kind = op[0] if isinstance(op, tuple | list) and op else None
    if kind == "insert":
        _, hashes, parent, holder, medium = op
        chain, parent_hash = chain_after(hashes, parent)
        return ("insert", chain, parent_hash, holder_name(holder, medium), None)
    if kind == "remove":
        _, hashes, holder, medium = op
        return ("remove", as_hashes(hashes), holder_name(holder, medium))
    if kind == "clear":
        _, holder, medium = op
        check_instance(holder, medium)
        return ("clear", holder, medium)
    raise ValueError(f"batch operation {kind!r}; use 'insert', 'remove' or 'clear'")


_DECODED = ("insert", "remove", "insert_engine", "remove_engine")


def prepare_all(ops: Sequence[tuple], hashes_checked: bool = False
                ) -> tuple[list[tuple], list[int], list[tuple[int, Exception]]]:
    """``(prepared, their positions in ops, [(position, error)] for the refused)``.

    ``hashes_checked``: the event decoder has checked the hashes already (uint64
    arrays, no hash twice, a parent not among them), so only the holder names are,
    once per name.  Then ops may also be ``("insert_engine", hashes, parent, holder,
    medium, root, tokens, block_size, lora_name)`` and ``("remove_engine", hashes,
    holder, medium, root)``, of engines whose blocks are keyed by their tokens
    (:mod:`sarp.aliases`).  Cost: O(blocks) for the hash checks; a dict read per operation
    when ``hashes_checked``.
    """
    prepared, positions, failed = [], [], []
    names: dict[tuple, str] = {}
    for i, op in enumerate(ops):
        try:
            kind = op[0] if hashes_checked else None
            if kind in _DECODED:
                key = (op[3], op[4]) if kind[0] == "i" else (op[2], op[3])
                name = names.get(key)
                if name is None:
                    name = names[key] = holder_name(*key)
                if kind == "insert":
                    prepared.append(("insert", op[1], op[2], name, None))
                elif kind == "remove":
                    prepared.append(("remove", op[1], name))
                elif kind == "insert_engine":  # sarp.aliases resolves these in the write
                    prepared.append((kind, op[1], op[2], name, *op[5:]))
                else:
                    prepared.append((kind, op[1], name, op[4]))
            else:
                prepared.append(prepare(op))
            positions.append(i)
        except (ValueError, TypeError) as exc:
            failed.append((i, exc))
    return prepared, positions, failed


def chain_after(hashes: HashesLike, parent: object) -> tuple[np.ndarray, int | None]:
    """An insert's hashes and parent, checked: no hash twice, the parent not among them."""
    chain = as_hashes(hashes)
    parent_hash = None if parent is None else as_hash(parent)
    fault = repeats(chain, parent_hash)
    if fault == "repeat":
        raise ValueError("hashes repeat a value; a chain of block hashes names each block "
                         "once (hash blocks with their parent, e.g. sarp.hash_blocks)")
    if fault == "parent":
        raise ValueError(f"parent={parent_hash} also appears in hashes; pass only the "
                         "blocks after it")
    return chain, parent_hash


def as_meta(meta: Sequence[int] | np.ndarray | None, num_blocks: int) -> np.ndarray | None:
    """An insert's per-block metadata, checked: one int in [0, 2**63) per block."""
    if meta is None:
        return None
    values = np.asarray(meta)
    if values.shape != (num_blocks,) or (values.size and values.dtype.kind not in "iu"):
        raise ValueError(
            f"meta has shape {values.shape} and dtype {values.dtype}; pass one int per block "
            f"({num_blocks} ints)"
        )
    if values.size and (values.min() < 0 or values.max() > np.iinfo(np.int64).max):
        raise ValueError("meta values must be ints in [0, 2**63); -1 is reserved for 'none'")
    return values.astype(np.int64)


@dataclass(slots=True)
class BatchResult:
    """What a batch did: operations refused (position, error), blocks new and removed."""

    operations: int
    failed: list[tuple[int, Exception]]
    new_blocks: int
    removed_per_op: list[int]


def batch_result(plan, refused: list[tuple[int, Exception]], positions: list[int],
                 failed: list[tuple[int, Exception]], num_ops: int) -> BatchResult:
    """What a batch of ``num_ops`` did, from the packer's plan and refusals of the
    operations it was given (``positions``: their places) and those ``failed``
    before it."""
    failed += [(positions[j], exc) for j, exc in refused]
    failed.sort(key=lambda f: f[0])
    removed = [0] * num_ops
    for j, count in enumerate(plan.removed_per_op):
        removed[positions[j]] = count
    return BatchResult(num_ops, failed, plan.new_blocks, removed)


class Batch:
    """Operations collected for one transaction: ``with index.batch() as b: b.insert(...)``."""

    def __init__(self, apply: Callable[[list[tuple], list[int], list, int], BatchResult]
                 ) -> None:
        self._apply = apply  # the index's: (prepared, positions, failed, operations)
        self._ops: list[tuple] = []
        self.result: BatchResult | None = None

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            n = len(self._ops)
            self.result = self._apply(self._ops, list(range(n)), [], n)

    def insert(self, hashes: HashesLike, parent: int | bytes | None = None, *, holder: str,
               medium: str = DEFAULT_MEDIUM) -> None:
        """Add an insert (as :meth:`Index.insert`, without ``meta``)."""
        self._ops.append(prepare(("insert", hashes, parent, holder, medium)))

    def remove(self, hashes: HashesLike, *, holder: str, medium: str = DEFAULT_MEDIUM) -> None:
        """Add a remove (as :meth:`Index.remove`)."""
        self._ops.append(prepare(("remove", hashes, holder, medium)))

    def clear(self, holder: str, medium: str | None = None) -> None:
        """Add a clear (as :meth:`Index.clear`)."""
        self._ops.append(prepare(("clear", holder, medium)))
