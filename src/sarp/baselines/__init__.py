"""Baseline indexes behind sarp's interface, for the benchmark.

Each module exposes ``open(path, durability=...)`` returning an object with
``insert(hashes, parent=None, *, holder, medium)``, ``match(hashes)`` (a result with
``num_blocks`` and ``storage_reads``), ``close()`` and ``stats()`` (with
``memory_bytes`` and ``disk_bytes``).  They track holders per block as a bitmask so
that they do the same bookkeeping sarp does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

NAMES = ("sarp", "memory-dict", "memory-radix", "lmdb-per-block", "rocksdb-per-block", "exact")


def opener(name: str) -> Callable[..., Any]:
    """The ``open`` function of the index called ``name``."""
    if name == "sarp":
        import sarp

        return sarp.open
    if name == "memory-dict":
        from . import memory_dict

        return memory_dict.open
    if name == "memory-radix":
        from . import memory_radix

        return memory_radix.open
    if name == "lmdb-per-block":
        from . import lmdb_per_block

        return lmdb_per_block.open
    if name == "rocksdb-per-block":
        from . import rocksdb_per_block

        return rocksdb_per_block.open
    if name == "exact":
        from . import exact

        return exact.open
    raise ValueError(f"index {name!r} is unknown; pick from {', '.join(NAMES)}")


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of every file below ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total
