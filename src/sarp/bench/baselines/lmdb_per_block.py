"""lmdb-per-block: an on-SSD index with one LMDB record per block (hash -> holder bits).

A match probes block by block in batches (one cursor ``getmulti`` per batch) and
stops at the first miss, as deployed per-block indexers do.  Baselines import
their storage engine directly; sarp itself reaches lmdb only through ``sarp.store``.
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
        bit = self.holders.bit(holder, medium)
        keys = keys_of(hashes)
        new = 0
        with self.env.begin(write=True) as txn:
            for key in keys:
                old = txn.get(key)
                bits = _BITS.unpack(old)[0] if old is not None else 0
                new += old is None
                txn.put(key, _BITS.pack(bits | bit))
        return new

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
