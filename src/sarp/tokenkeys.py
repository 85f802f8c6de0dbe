"""Blocks keyed by their tokens: keys that are the same for every engine and every
engine hash scheme, so that a router needs nothing but a request's tokens.

This is how the field's indexers key blocks (Mooncake RFC #1403; llm-d's and Dynamo's
indexers).  A block's *local hash* is the RFC's per-block hash: xxh3-64 with seed
1337 of its ``block_size`` tokens as little-endian u32, the seed moved to
``1337 + xxh3-64(name)`` under a LoRA adapter (as Dynamo's standalone indexer has it).
A local hash names a block's tokens but not the blocks before it, and SARP's
invariants need a block's key to name its whole prefix, so sarp chains them: the key
of block ``i`` is ``xxh3-64(local_i as 8 LE bytes, seed=key_{i-1})``, and the key
before the first block is the root of the block's model and tenant
(:func:`model_root`), so two models' blocks never share a key.

The engine's own hash of each block is kept beside its key (the ``aliases`` table,
:mod:`sarp.store`): it links a store to its parent and names the blocks a removal
evicts.  The keys are computed in C (``sarp._native.token_keys``); the Python here is
its reference.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import native
from .hashing import checksum

SEED = 1337  # the RFC's and Dynamo's xxh3 seed
DEFAULT_TENANT = "default"
_U64 = (1 << 64) - 1


def lora_seed(lora_name: str | None) -> int:
    """The local hashes' seed: 1337, or ``1337 + xxh3-64(name)`` under a LoRA adapter
    (an empty name is none).

    >>> lora_seed(None), lora_seed("")
    (1337, 1337)
    """
    if not lora_name:
        return SEED
    return (SEED + checksum(lora_name.encode())) & _U64


@lru_cache(maxsize=4096)
def model_root(model: str, tenant: str = DEFAULT_TENANT) -> int:
    """The key before the first block of ``model``'s (and ``tenant``'s) chains.
    Cost: an xxh3, or a cache lookup for a pair asked before.

    >>> model_root("m") == model_root("m", "default") != model_root("m", "t2")
    True
    """
    return checksum(b"sarp-model\0" + model.encode() + b"\0" + tenant.encode())


def token_keys(tokens: np.ndarray | list[int], block_size: int, *, parent: int,
               lora_name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, local hashes)`` of the full blocks of ``tokens`` (a partial last block
    is left out, as engines leave it), chained after the key ``parent`` (a block's, or
    :func:`model_root`).

    Cost: one xxh3 over each block's tokens and one over each local hash, in C.

    >>> root = model_root("m")
    >>> keys, local = token_keys(list(range(1, 10)), 4, parent=root)
    >>> len(keys), int(local[0])
    (2, 14643705804678351452)
    >>> bool(token_keys(list(range(5, 9)), 4, parent=int(keys[0]))[0][0] == keys[1])
    True
    """
    arr = np.ascontiguousarray(tokens, dtype=np.uint32)
    if block_size <= 0:
        raise ValueError(f"block_size={block_size!r}; pass the engine's block size (> 0)")
    return _keys(arr[: arr.size // block_size * block_size], 4, block_size,
                 lora_seed(lora_name), parent)


def chain_locals(local: np.ndarray | list[int], *, parent: int) -> np.ndarray:
    """The keys of blocks given by their local hashes (``/query_by_hash``), chained
    after ``parent``.

    >>> root = model_root("m")
    >>> keys, local = token_keys(list(range(8)), 4, parent=root)
    >>> bool((chain_locals(local, parent=root) == keys).all())
    True
    """
    arr = np.ascontiguousarray(local, dtype=np.uint64)
    return _keys(arr, 8, 1, 0, parent)[0]


def _keys(data: np.ndarray, width: int, block_size: int, seed: int, parent: int
          ) -> tuple[np.ndarray, np.ndarray]:
    c = native.C
    if c is not None:
        keys, local = c.token_keys(data, width, block_size, seed, parent)
        return np.frombuffer(keys, np.uint64), np.frombuffer(local, np.uint64)
    native.ran_python("token_keys")
    return _keys_python(data, width, block_size, seed, parent)


def _keys_python(data: np.ndarray, width: int, block_size: int, seed: int, parent: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The reference of ``sarp._native.token_keys``."""
    if width == 4:
        raw = data.astype("<u4").tobytes()
        step = 4 * block_size
        local = [checksum(raw[i:i + step], seed) for i in range(0, len(raw), step)]
    else:
        local = data.tolist()
    keys, key = [], parent
    for value in local:
        key = checksum(value.to_bytes(8, "little"), key)
        keys.append(key)
    return np.array(keys, np.uint64), np.array(local, np.uint64)
