"""memory-dict: a hash map of every block (what vLLM, llm-d and Mooncake's master keep),
backed by a snapshot file; a restart loads the file and rebuilds the map."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ._common import DictBlocks, HolderBits

SNAPSHOT = "blocks.npz"


def open(path: str | os.PathLike, **_: object) -> MemoryDictIndex:  # noqa: A001
    return MemoryDictIndex(Path(path))


class MemoryDictIndex(DictBlocks):
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
