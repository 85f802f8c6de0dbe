"""sarp: an on-SSD KV-cache prefix index for LLM serving.

>>> import tempfile, sarp
>>> with sarp.open(tempfile.mkdtemp()) as index:
...     _ = index.insert([101, 102, 103], holder="w3", medium="GPU")
...     m = index.match([101, 102, 999])
...     m.num_blocks, m.by_holder
(2, {'w3': 2})
"""

# The errors are imported with the package; the rest at first use (PEP 562), so that a
# command that needs none of it (``sarp serve``'s first answers, forked before numpy is
# imported: serving/early.py) does not pay for numpy and the core.
from .errors import (
    ChainConflictError,
    CorruptRecordError,
    DamagedIndexError,
    FormatVersionError,
    IndexClosedError,
    IndexLockedError,
    LeaseLostError,
    NotAnIndexError,
    ParentNotFoundError,
    ReadersFullError,
    ReadOnlyIndexError,
    SarpError,
    StoreError,
    StoreFullError,
)

_LAZY = {"Match": "answer", "as_hashes": "hashing", "hash_blocks": "hashing",
         "Index": "index", "open": "index", "ShardedIndex": "shards",
         "open_shards": "shards"}


def __getattr__(name: str):
    """``sarp.open``, ``sarp.Index`` and the rest, imported at first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sarp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "ChainConflictError",
    "CorruptRecordError",
    "DamagedIndexError",
    "FormatVersionError",
    "Index",
    "IndexClosedError",
    "IndexLockedError",
    "LeaseLostError",
    "Match",
    "NotAnIndexError",
    "ParentNotFoundError",
    "ReadOnlyIndexError",
    "ReadersFullError",
    "SarpError",
    "ShardedIndex",
    "StoreError",
    "StoreFullError",
    "as_hashes",
    "hash_blocks",
    "open",
    "open_shards",
]
