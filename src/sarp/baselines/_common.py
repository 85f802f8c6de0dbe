"""What the baselines share: the match result and the holder-bit bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..hashing import as_hashes


@dataclass(frozen=True, slots=True)
class BaselineMatch:
    num_blocks: int
    storage_reads: int = 0


class HolderBits:
    """(holder, medium) -> bit number, so a block's holders fit in one int."""

    def __init__(self) -> None:
        self.bits: dict[tuple[str, str], int] = {}

    def bit(self, holder: str, medium: str) -> int:
        key = (holder, medium)
        if key not in self.bits:
            if len(self.bits) >= 63:
                raise ValueError("baselines track at most 63 holders")
            self.bits[key] = len(self.bits)
        return 1 << self.bits[key]


def chain_of(hashes) -> np.ndarray:
    return as_hashes(hashes)
