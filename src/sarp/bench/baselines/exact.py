"""The reference answer: an unbounded exact prefix match over every block ever stored."""

from __future__ import annotations

import os

from ._common import DictBlocks, HolderBits


def open(path: str | os.PathLike | None = None, **_: object) -> ExactIndex:  # noqa: A001
    return ExactIndex()


class ExactIndex(DictBlocks):
    """A dict of block -> holder bits; no persistence (it is the answer key, not a contender)."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.holders = HolderBits()

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.blocks)}
