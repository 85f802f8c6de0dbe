"""memory-dict: a hash map of every block (what vLLM, llm-d and Mooncake's master keep),
backed by a snapshot file; a restart loads the file and rebuilds the map."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ._common import BaselineMatch, HolderBits, chain_of

SNAPSHOT = "blocks.npz"


def open(path: str | os.PathLike, **_: object) -> MemoryDictIndex:  # noqa: A001
    return MemoryDictIndex(Path(path))


class MemoryDictIndex:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.holders = HolderBits()
        snap = path / SNAPSHOT
        if snap.exists():
            with np.load(snap) as data:
                self.blocks = dict(zip(data["keys"].tolist(), data["bits"].tolist(), strict=True))
        else:
            self.blocks: dict[int, int] = {}

    def insert(self, hashes, parent=None, *, holder: str, medium: str = "GPU") -> int:
        bit = self.holders.bit(holder, medium)
        blocks = self.blocks
        new = 0
        for h in chain_of(hashes).tolist():
            old = blocks.get(h, 0)
            new += old == 0
            blocks[h] = old | bit
        return new

    def match(self, hashes) -> BaselineMatch:
        blocks = self.blocks
        n = 0
        for h in chain_of(hashes).tolist():
            if not blocks.get(h):
                break
            n += 1
        return BaselineMatch(n)

    def close(self) -> None:
        keys = np.fromiter(self.blocks.keys(), np.uint64, len(self.blocks))
        bits = np.fromiter(self.blocks.values(), np.uint64, len(self.blocks))
        tmp = self.path / (SNAPSHOT + ".tmp.npz")
        np.savez(tmp, keys=keys, bits=bits)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path / SNAPSHOT)

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.blocks)}
