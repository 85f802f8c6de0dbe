"""The reference answer: an unbounded exact prefix match over every block ever stored."""

from __future__ import annotations

import os

from ._common import BaselineMatch, HolderBits, chain_of


def open(path: str | os.PathLike | None = None, **_: object) -> ExactIndex:  # noqa: A001
    return ExactIndex()


class ExactIndex:
    """A dict of block -> holder bits; no persistence (it is the answer key, not a contender)."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.holders = HolderBits()

    def insert(self, hashes, parent=None, *, holder: str, medium: str = "GPU") -> int:
        bit = self.holders.bit(holder, medium)
        new = 0
        for h in chain_of(hashes).tolist():
            old = self.blocks.get(h, 0)
            new += old == 0
            self.blocks[h] = old | bit
        return new

    def match(self, hashes) -> BaselineMatch:
        n = 0
        blocks = self.blocks
        for h in chain_of(hashes).tolist():
            if not blocks.get(h):
                break
            n += 1
        return BaselineMatch(n)

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.blocks), "memory_bytes": 0, "disk_bytes": 0}
