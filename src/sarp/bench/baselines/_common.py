"""What the baselines share: the match result and the holder-bit bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...hashing import as_hashes
from ...store import hash_keys


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

    def mask(self, holder: str, medium: str | None) -> int:
        """The bits of ``holder`` in ``medium`` (every medium when None)."""
        return sum(1 << b for (h, m), b in self.bits.items()
                   if h == holder and (medium is None or m == medium))


def chain_of(hashes) -> np.ndarray:
    return as_hashes(hashes)


def keys_of(hashes) -> list[bytes]:
    """Big-endian 8-byte keys, the same layout sarp's own store uses."""
    return hash_keys(as_hashes(hashes))


class DictBlocks:
    """Block hash -> holder bits in a Python dict: the in-memory map's insert and match."""

    blocks: dict[int, int]
    holders: HolderBits

    def insert(self, hashes, parent=None, *, holder: str, medium: str = "GPU") -> int:
        bit = self.holders.bit(holder, medium)
        blocks = self.blocks
        new = 0
        for h in chain_of(hashes).tolist():
            old = blocks.get(h, 0)
            new += old == 0
            blocks[h] = old | bit
        return new

    def remove(self, hashes, *, holder: str, medium: str = "GPU") -> int:
        keep = ~self.holders.bit(holder, medium)
        blocks = self.blocks
        removed = 0
        for h in chain_of(hashes).tolist():
            old = blocks.get(h)
            if old is None:
                continue
            removed += old & ~keep != 0
            if old & keep:
                blocks[h] = old & keep
            else:
                del blocks[h]
        return removed

    def clear(self, holder: str, medium: str | None = None) -> int:
        mask = self.holders.mask(holder, medium)
        gone = [h for h, bits in self.blocks.items() if bits & mask]
        for h in gone:
            bits = self.blocks[h] & ~mask
            if bits:
                self.blocks[h] = bits
            else:
                del self.blocks[h]
        return len(gone)

    def apply_ops(self, ops) -> None:
        """Apply event operations (``sarp.Index.apply_batch``'s form), one after another."""
        for op in ops:
            if op[0] == "insert":
                self.insert(op[1], op[2], holder=op[3], medium=op[4])
            elif op[0] == "remove":
                self.remove(op[1], holder=op[2], medium=op[3])
            else:
                self.clear(op[1], op[2])

    def match(self, hashes) -> BaselineMatch:
        blocks = self.blocks
        n = 0
        for h in chain_of(hashes).tolist():
            if not blocks.get(h):
                break
            n += 1
        return BaselineMatch(n)


BATCH = 32
_NOBODY = b"\0" * 8


def probe(keys: list[bytes], fetch) -> BaselineMatch:
    """Probe a per-block store batch by batch; stop at the first block nobody holds.

    ``fetch(batch)`` returns one stored value (or ``None``) per key; every value
    fetched counts as a storage read.
    """
    n = reads = 0
    for start in range(0, len(keys), BATCH):
        for value in fetch(keys[start : start + BATCH]):
            reads += 1
            if value is None or value == _NOBODY:
                return BaselineMatch(n, reads)
            n += 1
    return BaselineMatch(n, reads)
