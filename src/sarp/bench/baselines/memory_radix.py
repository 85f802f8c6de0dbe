"""memory-radix: a radix tree over block hashes (Dynamo, SGLang style), snapshot-backed.

Each node is one block: {hash: [holder bits, children dict]}.  A restart loads the
snapshot (block, parent, bits in insertion order) and rebuilds the tree.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ._common import BaselineMatch, HolderBits, chain_of

SNAPSHOT = "tree.npz"


def open(path: str | os.PathLike, **_: object) -> MemoryRadixIndex:  # noqa: A001
    return MemoryRadixIndex(Path(path))


class MemoryRadixIndex:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.holders = HolderBits()
        self.root: dict[int, list] = {}
        self.nodes: dict[int, list] = {}  # hash -> node, for inserts that name a parent
        snap = path / SNAPSHOT
        if snap.exists():
            with np.load(snap) as data:
                for h, p, bits, is_root in zip(
                    data["keys"].tolist(), data["parents"].tolist(), data["bits"].tolist(),
                    data["roots"].tolist(), strict=True,
                ):
                    children = self.root if is_root else self.nodes[p][1]
                    node = children[h] = [bits, {}, p, is_root]
                    self.nodes[h] = node

    def insert(self, hashes, parent=None, *, holder: str, medium: str = "GPU") -> int:
        bit = self.holders.bit(holder, medium)
        if parent is None:
            children, prev, is_root = self.root, 0, True
        else:
            node = self.nodes.get(int(parent))
            if node is None:
                raise ValueError(f"parent {parent} is not in the tree")
            children, prev, is_root = node[1], int(parent), False
        new = 0
        for h in chain_of(hashes).tolist():
            node = children.get(h)
            if node is None:
                node = children[h] = [0, {}, prev, is_root]
                self.nodes[h] = node
                new += 1
            node[0] |= bit
            children, prev, is_root = node[1], h, False
        return new

    def match(self, hashes) -> BaselineMatch:
        children = self.root
        n = 0
        for h in chain_of(hashes).tolist():
            node = children.get(h)
            if node is None or not node[0]:
                break
            n += 1
            children = node[1]
        return BaselineMatch(n)

    def close(self) -> None:
        # dict order is insertion order, so every parent precedes its children.
        n = len(self.nodes)
        keys = np.fromiter(self.nodes.keys(), np.uint64, n)
        values = list(self.nodes.values())
        bits = np.fromiter((v[0] for v in values), np.uint64, n)
        parents = np.fromiter((v[2] for v in values), np.uint64, n)
        roots = np.fromiter((v[3] for v in values), np.bool_, n)
        tmp = self.path / (SNAPSHOT + ".tmp.npz")
        np.savez(tmp, keys=keys, parents=parents, bits=bits, roots=roots)
        os.replace(tmp, self.path / SNAPSHOT)

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.nodes)}
