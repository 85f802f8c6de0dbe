"""A writer's aliases, written behind (the LMDB store's; :mod:`sarp.store_lmdb`).

The ``aliases`` table is keyed by engine hashes, so the few aliases one small commit
adds land on as many leaf pages of it, and LMDB copies and writes each page whole:
the aliases were the larger share of a small commit's time (docs/performance.md,
"What holds the rate, bounded").  Here a commit's alias changes go instead

* to one record of the ``aliaslog`` table (sequential keys: an append dirties its last
  page), in the commit's own transaction, so nothing acknowledged is lost; and
* to memory (:class:`AliasLog`), which a lookup reads before the table.

Once memory holds over ``MAX_PENDING`` entries, each commit merges a sixteenth of the
key space (a *slice*: the engine hash's top four bits) from memory into the table, in
key order, where its changes share pages (a few thousand entries on a few dozen
pages); more slices while memory would still hold over ``MAX_PENDING``.  (An alias
whose block has left the index is merged all the same: a store without tokens, an
offload's, may still resolve through it; the sweep deletes it later, as before.)  A
round of slices after a record
was written, its every entry is in the table, and it is deleted.  A writer's open
reads the records left back into memory.  Only writers read aliases, so readers see
none of this.

An alias is a function of its key (:mod:`sarp.aliases`), so a record read back twice,
or merged twice, writes the same value again; records are read in order, so a later
delete wins over an earlier put of the same key.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from functools import partial
from itertools import compress, repeat
from operator import itemgetter

import numpy as np

SLICES = 16  # the key space's parts, one merged per commit
MAX_PENDING = 32768  # entries in memory past which a commit merges more than one slice
GONE = b""  # a pending delete (a value is 8 bytes)
MISS = b"?"  # not pending (1 byte: told apart by its length)
_KEY, _VALUE = 16, 8


def encode(changes: dict[bytes, bytes]) -> bytes:
    """One record: the keys (16 bytes each), then the values (8 bytes each; zeros for
    a delete), then a byte per entry, 1 for a delete.  Cost: C, no Python per entry.

    >>> encode({b"k" * 16: b"v" * 8, b"d" * 16: GONE})[-10:]
    b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x01'
    """
    values = list(changes.values())
    gone = np.frombuffer(bytes(map(GONE.__eq__, values)), np.bool_)
    padded = np.zeros((gone.size, _VALUE), np.uint8)
    padded[~gone] = np.frombuffer(b"".join(values), np.uint8).reshape(-1, _VALUE)
    return b"".join(changes) + padded.tobytes() + gone.tobytes()


def decode(record: bytes) -> dict[bytes, bytes]:
    """:func:`encode`'s changes again.  Cost: C, and Python per delete.

    >>> decode(encode({b"k" * 16: b"v" * 8, b"d" * 16: GONE})) == {b"k" * 16: b"v" * 8,
    ...                                                             b"d" * 16: GONE}
    True
    """
    n, left = divmod(len(record), _KEY + _VALUE + 1)
    if left:
        raise ValueError(f"an aliaslog record of {len(record)} bytes (25 per entry)")
    keys = np.frombuffer(record, "V16", n).tolist()
    values = np.frombuffer(record, "V8", n, _KEY * n).tolist()
    for i in np.flatnonzero(np.frombuffer(record, np.bool_, n, (_KEY + _VALUE) * n)).tolist():
        values[i] = GONE
    return dict(zip(keys, values, strict=True))


def by_slice(keys: list[bytes]) -> list[list[bytes]]:
    """``keys`` in their slices (the hash's top four bits, byte 8 of a key), each in
    the order given.  Cost: a sort of the slice numbers; C, no Python per key."""
    out: list[list[bytes]] = [[] for _ in range(SLICES)]
    if keys:
        slice_of = np.frombuffer(bytes(map(itemgetter(8), keys)), np.uint8) >> 4
        order = np.argsort(slice_of, kind="stable")
        ordered = list(map(keys.__getitem__, order.tolist()))
        bounds = np.searchsorted(slice_of[order], np.arange(SLICES + 1)).tolist()
        for s in range(SLICES):
            out[s] = ordered[bounds[s] : bounds[s + 1]]
    return out


class AliasLog:
    """What a writer's commits changed of ``aliases`` and have not merged yet, by slice.

    Cost: a dict entry per pending alias (about 150 bytes, for at most about
    ``MAX_PENDING`` plus one commit's); a lookup is a dict probe per key, in C.

    >>> log = AliasLog()
    >>> key = bytes(8) + bytes([0x70]) + bytes(7)  # root 0, a hash in slice 7
    >>> log.committed({key: b"v" * 8}, by_slice([key]), merged=[], ends_round=False)
    >>> log.get([key, bytes(16)]) == [b"v" * 8, MISS]
    True
    """

    def __init__(self) -> None:
        self.pending: dict[bytes, bytes] = {}  # key -> value, or GONE
        self.slices: list[list[bytes]] = [[] for _ in range(SLICES)]  # keys, maybe twice
        self.next_slice = 0
        self.next_seq = 0  # the next record's key
        self.round_start = 0  # a round ending deletes the records below this
        self.max_pending = MAX_PENDING  # (0: every commit merges all: written through)

    @classmethod
    def read(cls, records: Iterable[tuple[int, bytes]]) -> AliasLog:
        """The memory of a writer's open: ``records`` (the ``aliaslog`` table's, in
        order) read back; a later change wins.  Cost: C per record, no Python per
        entry but for deletes."""
        log = cls()
        for seq, record in records:
            changes = decode(record)
            log.committed(changes, by_slice(list(changes)), [], False)
            log.next_seq = seq + 1
        log.round_start = log.next_seq
        return log

    def get(self, keys: list[bytes], stage: dict[bytes, bytes] | None = None) -> list[bytes]:
        """Each key's pending value (GONE for a pending delete, ``MISS`` if none),
        ``stage`` (a write's own changes) over memory."""
        if not stage:
            return list(map(self.pending.get, keys, repeat(MISS)))
        # (a write that looks up after it changed aliases: rare, Python per key)
        return [stage.get(k, self.pending.get(k, MISS)) for k in keys]

    def to_merge(self, staged: int) -> list[int]:
        """The slices a commit merges: while memory would hold more than
        ``MAX_PENDING`` entries, the next ones in turn (a whole round at most); none
        below it, so that a slice's merge writes many entries to each page."""
        out, left = [], len(self.pending) + staged
        for k in range(SLICES):
            if left <= self.max_pending:
                break
            s = (self.next_slice + k) % SLICES
            out.append(s)
            left -= len(self.slices[s])
        return out

    def entries(self, s: int, staged: list[bytes], stage: dict[bytes, bytes]
                ) -> dict[bytes, bytes]:
        """Slice ``s`` as the commit leaves it: its pending entries, and the commit's
        own (``staged``: the stage's keys in that slice) over them."""
        keys = self.slices[s]
        out = dict(zip(keys, map(self.pending.__getitem__, keys), strict=True))
        out.update(zip(staged, map(stage.__getitem__, staged), strict=True))
        return out

    def committed(self, stage: dict[bytes, bytes], staged: list[list[bytes]],
                  merged: list[int], ends_round: bool) -> None:
        """A commit went through: take its ``stage`` (``staged``: its keys by slice),
        then drop the ``merged`` slices, which its transaction wrote to the table."""
        self.pending.update(stage)
        for s, keys in enumerate(staged):
            self.slices[s].extend(keys)
        for s in merged:
            deque(map(self.pending.pop, self.slices[s], repeat(None)), maxlen=0)
            self.slices[s] = []
        if merged:
            self.next_slice = (merged[-1] + 1) % SLICES
        if stage:
            self.next_seq += 1
        if ends_round:
            self.round_start = self.next_seq


def split(entries: dict[bytes, bytes]) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """A slice's merge: ``(puts, deletes)`` for the table, each in key order.  Cost: a
    sort; C, no Python per entry.

    >>> split({b"b" * 16: b"v" * 8, b"a" * 16: GONE})
    ([(b'bbbbbbbbbbbbbbbb', b'vvvvvvvv')], [b'aaaaaaaaaaaaaaaa'])
    """
    keys = sorted(entries)
    values = list(map(entries.__getitem__, keys))
    deletes = list(compress(keys, map(GONE.__eq__, values)))
    if deletes:
        present = list(map(GONE.__ne__, values))
        keys, values = list(compress(keys, present)), list(compress(values, present))
    return list(zip(keys, values, strict=True)), deletes


class WrittenBehind:
    """The aliases of a store's write transaction, written behind (see the module):
    the write has ``_stage`` (a dict), ``_store.alias_log`` and the table
    primitives ``_aliases_get``, ``_aliases_write``, ``_aliaslog_append`` and
    ``_aliaslog_trim``; its store calls :meth:`merge_aliases` before the commit."""

    __slots__ = ()

    def alias_found(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """Found aliases: this write's changes and those not merged yet, then the table
        for the rest.  Cost: a dict probe per key and one table lookup, in C."""
        got = self._store.alias_log.get(keys, self._stage)
        size = np.fromiter(map(len, got), np.int8, len(got))
        held = (size == _VALUE).tolist()
        out = dict(zip(compress(keys, held), compress(got, held)))  # noqa: B905 (equal)
        out.update(self._aliases_get(list(compress(keys, (size == len(MISS)).tolist()))))
        return out

    def alias_put(self, keys: list[bytes], values: list[bytes]) -> None:
        self._stage.update(zip(keys, values, strict=True))

    def alias_delete(self, keys: list[bytes]) -> None:
        self._stage.update(zip(keys, repeat(GONE)))

    def merge_aliases(self) -> Callable[[], None]:
        """Before the write commits: its alias changes as one ``aliaslog`` record, the
        slices due merged into ``aliases`` in key order, and the records a round of
        slices has covered deleted; returns what memory does once the commit went
        through.  Cost: one append, and one sorted write per merged slice."""
        log, stage = self._store.alias_log, self._stage
        if not stage and not log.pending:
            return _nothing
        staged = by_slice(list(stage))
        merged = log.to_merge(len(stage))
        for s in merged:
            self._aliases_write(*split(log.entries(s, staged[s], stage)))
        if stage:
            self._aliaslog_append(log.next_seq, encode(stage))
        ends_round = SLICES - 1 in merged
        if ends_round:
            self._aliaslog_trim(log.round_start)
        return partial(log.committed, stage, staged, merged, ends_round)


def _nothing() -> None:
    """What a write that changed no alias and merged none does after its commit."""
