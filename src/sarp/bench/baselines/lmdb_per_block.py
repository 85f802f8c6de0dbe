"""lmdb-per-block: an on-SSD index with one LMDB record per block (hash -> holder bits).

A match probes block by block in batches (one cursor ``getmulti`` per batch) and
stops at the first miss, as deployed per-block indexers do.  Baselines import
their storage engine directly; sarp itself reaches lmdb only through ``sarp.store_lmdb``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import lmdb

from ._common import BaselineMatch, HolderBits, keys_of, probe

_BITS = struct.Struct("<Q")


def open(path: str | os.PathLike, durability: str = "sync", **_: object) -> LmdbPerBlockIndex:  # noqa: A001
    return LmdbPerBlockIndex(Path(path), durability)



class LmdbPerBlockIndex:
    def __init__(self, path: Path, durability: str) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.env = lmdb.open(str(path), map_size=1 << 36, sync=durability == "sync",
                             metasync=durability == "sync", readahead=False)
        self.holders = HolderBits()

    def insert(self, hashes, parent=None, *, holder: str, medium: str = "GPU") -> int:
        with self.env.begin(write=True) as txn:
            return self._insert(txn, hashes, holder, medium)

    def _insert(self, txn, hashes, holder: str, medium: str) -> int:
        bit = self.holders.bit(holder, medium)
        new = 0
        for key in keys_of(hashes):
            old = txn.get(key)
            bits = _BITS.unpack(old)[0] if old is not None else 0
            new += old is None
            txn.put(key, _BITS.pack(bits | bit))
        return new

    def _remove(self, txn, hashes, holder: str, medium: str) -> int:
        keep = ~self.holders.bit(holder, medium)
        removed = 0
        for key in keys_of(hashes):
            old = txn.get(key)
            if old is None:
                continue
            bits = _BITS.unpack(old)[0]
            removed += bits & ~keep != 0
            if bits & keep:
                txn.put(key, _BITS.pack(bits & keep))
            else:
                txn.delete(key)
        return removed

    def _clear(self, txn, holder: str, medium: str | None) -> None:
        mask = self.holders.mask(holder, medium)
        changes = [(key, _BITS.unpack(v)[0] & ~mask) for key, v in txn.cursor()
                   if _BITS.unpack(v)[0] & mask]
        for key, bits in changes:
            if bits:
                txn.put(key, _BITS.pack(bits))
            else:
                txn.delete(key)

    def apply_ops(self, ops) -> None:
        """Apply event operations (``sarp.Index.apply_batch``'s form) in one transaction."""
        with self.env.begin(write=True) as txn:
            for op in ops:
                if op[0] == "insert":
                    self._insert(txn, op[1], op[3], op[4])
                elif op[0] == "remove":
                    self._remove(txn, op[1], op[2], op[3])
                else:
                    self._clear(txn, op[1], op[2])

    def match(self, hashes) -> BaselineMatch:
        with self.env.begin() as txn:
            cursor = txn.cursor()

            def fetch(batch: list[bytes]) -> list[bytes | None]:
                found = dict(cursor.getmulti(batch))
                return [found.get(key) for key in batch]

            return probe(keys_of(hashes), fetch)

    def close(self) -> None:
        self.env.close()

    def stats(self) -> dict[str, int]:
        return {"blocks": self.env.stat()["entries"]}
