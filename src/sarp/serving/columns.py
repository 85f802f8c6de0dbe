"""A commit's events as columns: the batches the subscriber applies in line, decoded
straight into arrays (``sarp._native.decode_into``), with no Python object per event,
and handed to the index as they are (:meth:`sarp.Index.apply_decoded`).

One row per store or removal: its kind (0 store, 1 removal), its stored holder name
(an index into :attr:`Columns.names`: ``holder`` and medium), its model root (0: keyed
by the engine's hashes), its block count (its hashes in ``hashes``, in row order),
its parent, and, for a store keyed by tokens that carries the tokens of all its
blocks, their count, the block size, the LoRA seed (:func:`sarp.tokenkeys.lora_seed`)
and each block's local hash (in ``locals``: the first step of its key, an xxh3 of its
tokens, taken as the events are decoded; the tokens themselves are not kept).  Events
of another KV cache group are read and counted, not kept (as
:class:`sarp.serving.applier.Applier` skips them).

A batch the columns do not take (a clear, a malformed event, a medium sarp refuses,
anything the C decoder leaves to Python) leaves them as they were, and goes the
applier's way with :func:`sarp.serving.events.decode`.  :meth:`Columns.add` without
the extension is the reference the C is tested against (tests/test_columns.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import native
from ..holders import holder_name, split_name
from ..tokenkeys import lora_seed, token_keys
from .events import BadEvent, Removed, Stored, decode, tier_of

FIELDS = ("kind", "name", "root", "size", "parent", "has_parent", "token_count",
          "block_size", "seed", "hashes", "locals")  # decode_into's order (and, after
# them, its own column: the token ids of the store it reads, hashed and dropped)
DTYPES = (np.uint8, np.int32, np.uint64, np.int64, np.uint64, np.uint8, np.int64, np.int64,
          np.uint64, np.uint64, np.uint64)
LEARNED = 4096  # (holder, medium) pairs and LoRA names remembered, at most


class NotLearnt(LookupError):
    """A LoRA name that columns made by ``copy(learning=False)`` have not met."""


@dataclass(slots=True)
class Taken:
    """What :meth:`Columns.take` hands over: one array per field, and the names."""

    kind: np.ndarray
    name: np.ndarray
    root: np.ndarray
    size: np.ndarray
    parent: np.ndarray
    has_parent: np.ndarray
    token_count: np.ndarray
    block_size: np.ndarray
    seed: np.ndarray
    hashes: np.ndarray
    locals: np.ndarray  # per block of a store keyed by tokens: tokenkeys' local hash
    names: list[str]
    loras: dict[int, str | None]  # seed -> LoRA name

    @property
    def starts(self) -> np.ndarray:
        """Where each row's hashes begin in ``hashes``."""
        return np.cumsum(self.size) - self.size

    def chain(self, row: int) -> np.ndarray:
        at = int(self.size[:row].sum())
        return self.hashes[at : at + int(self.size[row])]


class Columns:
    """The columns of the next commit; see the module docstring.

    Cost: about a microsecond of C per event and a copy of its hashes (and an xxh3 of
    each block's tokens); a Python call only for a (holder, medium) pair or a LoRA name
    not seen before.

    >>> import msgpack
    >>> cols = Columns()
    >>> raw = msgpack.packb([1.5, [["BlockStored", [7, 8], None, [], 16, None, "GPU"]]])
    >>> cols.add(raw, "e0#0", None, tokens=False)
    (1.5, None, 1, 0)
    >>> t = cols.take()
    >>> t.hashes.tolist(), [t.names[i] for i in t.name]
    ([7, 8], ['e0#0\\x00GPU'])
    """

    def __init__(self) -> None:
        self._cols = [bytearray() for _ in FIELDS] + [bytearray()]  # (+ decode_into's)
        self._holders: dict[str, int] = {}
        self._holder_list: list[str] = []
        self._pairs: dict[tuple[int, str | None], int | None] = {}  # (holder, medium sent)
        self._names: dict[str, int] = {}
        self.names: list[str] = []  # stored names, as the rows index them
        self._seeds: dict[str | None, int] = {}
        self._ctx = (self._cols, self._pairs, self._learn_name, self._seeds, self._learn_seed)

    def __len__(self) -> int:
        return len(self._cols[0])

    def _learn_name(self, pair: tuple[int, str | None]) -> int | None:
        holder, sent = pair
        medium = tier_of(sent)
        index = None
        if medium is not None:
            try:
                name = holder_name(self._holder_list[holder], medium)
            except ValueError:
                name = None
            if name is not None:
                index = self._names.get(name)
                if index is None:
                    index = self._names[name] = len(self.names)
                    self.names.append(name)
        if len(self._pairs) < LEARNED:
            self._pairs[pair] = index
        return index

    def _learn_seed(self, lora_name: str | None) -> int:
        seed = lora_seed(lora_name)
        if len(self._seeds) < LEARNED:
            self._seeds[lora_name] = seed
        return seed

    def holder_number(self, holder: str) -> int:
        """The number the C decoder knows ``holder`` by (``ctx``'s: learnt on first use)."""
        number = self._holders.get(holder)
        if number is None:
            number = self._holders[holder] = len(self._holder_list)
            self._holder_list.append(holder)
        return number

    @property
    def ctx(self) -> tuple:
        """What the C decoder appends to: the columns and what learns their names."""
        return self._ctx

    def mark(self) -> tuple[int, ...]:
        """Where the columns end now (for :meth:`rollback`)."""
        return tuple(map(len, self._cols))

    def rollback(self, mark: tuple[int, ...]) -> None:
        """Drop what was added after ``mark``."""
        for col, at in zip(self._cols, mark, strict=True):
            del col[at:]

    def add(self, payload: bytes, holder: str, root: int | None, *, tokens: bool
            ) -> tuple[float, int | None, int, int] | None:
        """Append a batch's stores and removals under ``holder`` (a store keyed by its
        tokens under ``root``, when given; ``tokens``: read them); returns ``(ts,
        dp_rank, events, skipped)`` (``skipped``: events of another KV cache group,
        not added), or None with the columns as they were.
        """
        number = self.holder_number(holder)
        if native.C is not None:
            return native.C.decode_into(payload, tokens, root or 0, number, self._ctx)
        native.ran_python("decode_into")
        return self._add_python(payload, number, root or 0, tokens)

    def _add_python(self, payload: bytes, holder: int, root: int, tokens: bool):
        """:meth:`add` with :func:`decode` (the reference of ``decode_into``)."""
        try:
            batch = decode(payload, tokens and root != 0)
        except BadEvent:
            return None
        mark, skipped = self.mark(), 0
        for event in batch.events:
            if type(event) not in (Stored, Removed):
                self.rollback(mark)
                return None
            name = self._learn_name((holder, event.medium))
            if name is None:
                self.rollback(mark)
                return None
            if event.group_idx not in (None, 0):
                skipped += 1
                continue
            n = int(event.block_hashes.size)
            row = [int(type(event) is Removed), name, root, n, 0, 0, 0, 0, 0]
            if type(event) is Stored:
                if event.parent is not None:
                    row[4:6] = [event.parent, 1]
                t, size = event.token_ids, event.block_size
                if root and t is not None and size and t.size >= n * size:
                    row[6:9] = [n * size, size, self._learn_seed(event.lora_name)]
                    _, local = token_keys(t[: n * size], size, parent=0,
                                          lora_name=event.lora_name)
                    self._cols[10] += local.tobytes()
            for col, value, dtype in zip(self._cols, row, DTYPES, strict=False):
                col += np.array([value], dtype).tobytes()
            self._cols[9] += np.ascontiguousarray(event.block_hashes, np.uint64).tobytes()
        return batch.ts, batch.dp_rank, len(batch.events), skipped

    def learnt(self) -> tuple[list[tuple], list[tuple]] | None:
        """What the C decoder reads without asking Python (``lane_prefetch``): the
        (holder number, medium sent, name index or None) of each pair met, and the
        (LoRA name, seed) of each name; None when the next :meth:`take` forgets them,
        as then the rows decoded with them now would name others.

        >>> Columns().learnt()
        ([], [])
        """
        if len(self.names) + len(self._holder_list) > LEARNED:
            return None
        return [(h, m, i) for (h, m), i in self._pairs.items()], list(self._seeds.items())

    def copy(self, learning: bool = True) -> Columns:
        """Empty columns that know the names these know; with ``learning=False``, those
        alone (a pair not met reads as a medium refused, a LoRA name as
        :class:`NotLearnt`), as ``lane_prefetch`` decodes.  :meth:`extend` gives
        their rows back."""
        other = Columns()
        other._holders, other._holder_list = dict(self._holders), list(self._holder_list)
        other._pairs, other._names = dict(self._pairs), dict(self._names)
        other.names, other._seeds = list(self.names), dict(self._seeds)
        if not learning:
            def seed_of(lora_name: str | None) -> int:
                if lora_name in other._seeds:
                    return other._seeds[lora_name]
                raise NotLearnt(lora_name)

            other._learn_name, other._learn_seed = other._pairs.get, seed_of
            other._ctx = (other._cols, other._pairs, other._learn_name, other._seeds,
                          other._learn_seed)
        return other

    def extend(self, other: Columns) -> None:
        """Append the rows of ``other``, made by :meth:`copy` of these (the same names)."""
        for mine, theirs in zip(self._cols, other._cols, strict=True):
            mine += theirs

    def take(self) -> Taken:
        """Everything added, as arrays (copied out), and empty columns again.

        Cost: one copy of the columns.
        """
        arrays = [np.frombuffer(bytes(c), d) for c, d in zip(self._cols, DTYPES, strict=False)]
        for c in self._cols:
            c.clear()
        taken = Taken(*arrays, names=list(self.names),
                      loras={seed: name for name, seed in self._seeds.items()})
        if len(self.names) + len(self._holder_list) > LEARNED:
            # a stream of new names (engines coming and going, odd media) must not grow
            # them for ever: no row names them now, so they start again
            self.names.clear()
            self._names.clear()
            self._pairs.clear()
            self._holders.clear()
            self._holder_list.clear()
        return taken

    def parts(self, index: int) -> tuple[str, str]:
        """The holder and medium of stored name ``index``."""
        return split_name(self.names[index])
