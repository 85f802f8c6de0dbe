"""rocksdb-per-block: one RocksDB record per block (hash -> holder bits), via rocksdict.

A match multi-gets the chain in batches and stops at the first miss.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from ._common import BaselineMatch, HolderBits, keys_of, probe

_BITS = struct.Struct("<Q")


def open(path: str | os.PathLike, durability: str = "sync", **_: object) -> RocksPerBlockIndex:  # noqa: A001
    return RocksPerBlockIndex(Path(path), durability)



class RocksPerBlockIndex:
    def __init__(self, path: Path, durability: str) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = Rdict(str(path / "rocks"), options=Options(raw_mode=True))
        opts = WriteOptions()
        opts.sync = durability == "sync"
        self.db.set_write_options(opts)
        self.holders = HolderBits()

    def insert(self, hashes, parent=None, *, holder: str, medium: str = "GPU") -> int:
        bit = self.holders.bit(holder, medium)
        keys = keys_of(hashes)
        old = self.db.get(keys)
        new = 0
        batch = WriteBatch(raw_mode=True)
        for key, value in zip(keys, old, strict=True):
            bits = _BITS.unpack(value)[0] if value is not None else 0
            new += value is None
            batch.put(key, _BITS.pack(bits | bit))
        self.db.write(batch)
        return new

    def match(self, hashes) -> BaselineMatch:
        return probe(keys_of(hashes), self.db.get)

    def close(self) -> None:
        self.db.close()

    def stats(self) -> dict[str, int]:
        return {}
