"""sarp: an on-SSD KV-cache prefix index for LLM serving.

>>> import tempfile, sarp
>>> with sarp.open(tempfile.mkdtemp()) as index:
...     _ = index.insert([101, 102, 103], holder="w3", medium="GPU")
...     m = index.match([101, 102, 999])
...     m.num_blocks, m.by_holder
(2, {'w3': 2})
"""

# Most indexes are folders: the LMDB backend is imported with sarp, so that opening one
# does not pay for importing lmdb (the valkey client is imported only for a URL).
from . import store_lmdb  # noqa: F401
from .answer import Match
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
from .hashing import as_hashes, hash_blocks
from .index import Index, open
from .shards import ShardedIndex, open_shards

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
