"""Block hashes: one normalisation point for every form engines send, and chained hashing.

Engines send block hashes as unsigned 64-bit ints (vLLM), signed int64 (SGLang), or
bytes (vLLM with int hashes off: the low 64 bits, big-endian).  :func:`as_hashes`
turns all of them into one contiguous ``numpy.uint64`` array; the rest of sarp
only ever sees that form.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

HashesLike = Sequence[int] | Sequence[bytes] | np.ndarray

# xxh3-64, the checksum of segment records, snapshots, holder names and frames (this
# module is xxhash's one door): of bytes as an int, as 8 bytes, and streaming.
checksum = xxhash.xxh3_64_intdigest
checksum_bytes = xxhash.xxh3_64_digest
Checksum = xxhash.xxh3_64

_U64_MAX = (1 << 64) - 1
_I64_MIN = -(1 << 63)


def as_hashes(hashes: HashesLike, *, name: str = "hashes", allow_empty: bool = False) -> np.ndarray:
    """Normalise block hashes to a contiguous ``uint64`` array.

    Accepts a list/tuple of ints in ``[-2**63, 2**64)`` (negative ints are signed
    int64 and keep their bit pattern), a list of ``bytes`` (the low 64 bits,
    big-endian, as vLLM sends them), or a numpy integer array.

    Cost: O(n), vectorised for numpy input and for ints that fit one dtype.

    >>> as_hashes([1, 2, -1]).tolist()
    [1, 2, 18446744073709551615]
    >>> as_hashes([b"\\x00" * 7 + b"\\x05"]).tolist()
    [5]
    """
    if (
        type(hashes) is np.ndarray
        and hashes.dtype == np.uint64
        and hashes.ndim == 1
        and hashes.size
        and hashes.flags.c_contiguous
    ):
        return hashes  # the engine-side fast path: already normalised
    if isinstance(hashes, np.ndarray):
        arr = _from_array(hashes, name)
    elif isinstance(hashes, bytes | bytearray | memoryview | str):
        raise TypeError(
            f"{name} must be a sequence of block hashes, got a single {type(hashes).__name__} "
            f"{bytes(hashes[:16]) if not isinstance(hashes, str) else hashes[:16]!r}; "
            "wrap it in a list: [h]"
        )
    elif isinstance(hashes, Iterable):
        arr = _from_sequence(list(hashes), name)
    else:
        raise TypeError(
            f"{name} must be a list of ints, a list of bytes or a numpy integer array, "
            f"got {type(hashes).__name__}"
        )
    if arr.size == 0 and not allow_empty:
        raise ValueError(f"{name} is empty; pass at least one block hash")
    return arr


def as_hash(value: int | bytes | np.integer, *, name: str = "parent") -> int:
    """Normalise one block hash (int, signed int64 or bytes) to a Python int in [0, 2**64).

    >>> as_hash(-1) == 2**64 - 1
    True
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or bytes block hash, got bool {value!r}")
    if isinstance(value, bytes | bytearray):
        return _bytes_to_int(bytes(value), name)
    if isinstance(value, int | np.integer):
        v = int(value)
        if not _I64_MIN <= v <= _U64_MAX:
            raise ValueError(
                f"{name}={v} is outside 64 bits; block hashes are uint64 or signed int64 "
                "(mask with & (2**64 - 1) if your engine uses wider hashes)"
            )
        return v & _U64_MAX
    raise TypeError(f"{name} must be an int or bytes block hash, got {type(value).__name__}")


def _from_array(arr: np.ndarray, name: str) -> np.ndarray:
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}; pass one chain")
    if arr.dtype == np.uint64:
        return np.ascontiguousarray(arr)
    if arr.dtype == np.int64:
        return np.ascontiguousarray(arr).view(np.uint64)
    if arr.dtype.kind in "iu":
        if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
            # Narrow signed types: sign-extend to int64 first, then keep the bit pattern.
            return arr.astype(np.int64).view(np.uint64)
        return arr.astype(np.uint64)
    if arr.dtype == object:
        return _from_sequence(arr.tolist(), name)
    raise TypeError(
        f"{name} has dtype {arr.dtype}; block hashes must be integers "
        "(uint64, int64) or a list of bytes"
    )


def _from_sequence(items: list, name: str) -> np.ndarray:
    if not items:
        return np.empty(0, dtype=np.uint64)
    # The element types, gathered in C (a generator would run Python code per block).
    types = set(map(type, items))
    if types <= {bytes, bytearray}:
        return _from_bytes(items, name)
    if types == {int}:
        # Plain ints (what JSON and msgpack give): numpy converts them in C. A list
        # mixing ints above 2**63 with small ones would otherwise become float64.
        try:
            return np.array(items, dtype=np.int64).view(np.uint64)
        except OverflowError:
            pass
        try:
            return np.array(items, dtype=np.uint64)
        except OverflowError:
            pass  # mixed signs beyond int64, or beyond 64 bits: checked one by one below
    if all(isinstance(v, np.integer) for v in items):
        arr = np.asarray(items)
        if arr.dtype.kind in "iu" and arr.ndim == 1:
            return _from_array(arr, name)
    # Mixed types, bools, floats, or ints beyond one dtype: check one by one.
    out = np.empty(len(items), dtype=np.uint64)
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, int | np.integer | bytes | bytearray):
            raise TypeError(
                f"{name}[{i}] is {type(v).__name__} {v!r}; block hashes must be ints or bytes"
            )
        out[i] = as_hash(v, name=f"{name}[{i}]")
    return out


def repeats(hashes: np.ndarray, parent: int | None = None) -> str | None:
    """Why ``hashes`` cannot be a chain after ``parent``: ``"repeat"`` if a hash occurs
    twice, ``"parent"`` if ``parent`` is one of them; else None.

    Cost: a set of the values for short chains, one sort for long ones (what is
    cheaper at each size; both in C).

    >>> repeats(np.array([1, 2, 1], np.uint64)), repeats(np.array([1, 2], np.uint64), 2)
    ('repeat', 'parent')
    """
    if hashes.size <= 64:
        distinct = set(hashes.tolist())
        if len(distinct) != hashes.size:
            return "repeat"
        return "parent" if parent is not None and parent in distinct else None
    ordered = np.sort(hashes)
    if bool((ordered[1:] == ordered[:-1]).any()):
        return "repeat"
    if parent is not None:
        i = int(ordered.searchsorted(np.uint64(parent)))
        if i < ordered.size and int(ordered[i]) == parent:
            return "parent"
    return None


def _from_bytes(items: list, name: str) -> np.ndarray:
    """The low 64 bits, big-endian, of each bytes hash; vectorised when all have one
    length (sha256 digests are 32 bytes)."""
    size = len(items[0])
    if size and set(map(len, items)) == {size}:
        raw = np.frombuffer(b"".join(items), np.uint8).reshape(len(items), size)
        low = np.zeros((len(items), 8), np.uint8)
        take = min(size, 8)
        low[:, 8 - take :] = raw[:, size - take :]
        return low.view(">u8").ravel().astype(np.uint64)
    return np.fromiter(
        (_bytes_to_int(bytes(b), f"{name}[{i}]") for i, b in enumerate(items)),
        dtype=np.uint64,
        count=len(items),
    )


def _bytes_to_int(b: bytes, name: str) -> int:
    if not b:
        raise ValueError(f"{name} is an empty bytes value; a bytes block hash needs 1+ bytes")
    return int.from_bytes(b[-8:], "big")


SCHEMES = ("xxh3", "vllm-sha256", "vllm-sha256-cbor", "vllm-xxhash", "vllm-xxhash-cbor",
           "sglang")
# vLLM's --prefix-caching-hash-algo name of each of its schemes; its default is sha256
VLLM_ALGOS = {"vllm-sha256": "sha256", "vllm-sha256-cbor": "sha256_cbor",
              "vllm-xxhash": "xxhash", "vllm-xxhash-cbor": "xxhash_cbor"}
VLLM_DEFAULT_SCHEME = "vllm-sha256"  # vLLM 0.33's default (sha256 of the pickled tuple)
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM 0.12+ when PYTHONHASHSEED is unset (sha256 schemes)


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: int | bytes | None = None,
    extra: bytes | str | None = None,
    *,
    scheme: str = "xxh3",
    seed: str | None = None,
    extra_keys: Sequence[tuple | None] | None = None,
) -> np.ndarray:
    """The block hashes of the full blocks of ``token_ids``, as the engines' events carry them.

    A trailing partial block is ignored.  ``scheme`` picks whose hash:

    * ``"xxh3"`` (sarp's own): block ``i`` is xxh3-64 of its parent's hash
      (``parent`` for the first block, 0 when ``None``), ``extra`` (a namespace
      such as a LoRA name or cache salt) and its tokens as little-endian uint32;
    * ``"vllm-sha256"`` (vLLM's default), ``"vllm-sha256-cbor"``, ``"vllm-xxhash"``
      and ``"vllm-xxhash-cbor"``: vLLM's prefix-caching hashes
      (``--prefix-caching-hash-algo sha256``, ``sha256_cbor``, ``xxhash``,
      ``xxhash_cbor``): SHA-256, or xxh3-128, of the pickled / canonical-CBOR tuple
      ``(parent digest, token ids, extra keys)``, the first block's parent being
      ``NONE_HASH`` = hash of ``seed``.  ``seed`` defaults to ``$PYTHONHASHSEED``,
      else ``"vllm-none-hash"`` (what vLLM 0.12 on uses for the sha256 schemes;
      for the xxhash ones, and in vLLM 0.11 and older, an engine without
      ``PYTHONHASHSEED`` draws a random seed, so set it on the engines).
      ``extra_keys`` is vLLM's per-block tuple (LoRA, multimodal, cache salt) or
      ``None``; equal keys hash equal however they were built (lists are taken as
      tuples and strings are interned before pickling, as vLLM's tags are literals).
      The value returned is the low 64 bits of each digest, which is what vLLM's
      events carry;
    * ``"sglang"``: SGLang 0.5.x's page hash: SHA-256 of the previous page's digest
      and the page's tokens as little-endian uint32 (uint64 after a 0xff byte for a
      page with a token of 2**32 or more); the value is the digest's first 8 bytes.
      ``seed`` is the request's ``cache_salt`` (the first page then chains on
      ``sha256("sglang-cache-salt-v1\\0" + salt)``); a LoRA adapter (SGLang's
      ``extra_key``) does not enter SGLang 0.5.23's event hashes.

    For the vLLM and SGLang schemes ``parent`` is the previous block's full digest
    (:func:`block_digests`: 32 bytes, 16 for xxhash), since a 64-bit value cannot
    continue a chain.

    Cost: O(len(token_ids)), one hash call per block.

    >>> h = hash_blocks(list(range(40)), 16)
    >>> len(h), bool((h == hash_blocks(list(range(32)), 16)).all())
    (2, True)
    >>> hash_blocks(list(range(32)), 16, scheme="vllm-sha256-cbor", seed="0").dtype
    dtype('uint64')
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}; pick one of {SCHEMES}")
    if scheme == "xxh3":
        tokens, num_blocks = _blocks(token_ids, block_size)
        return _xxh3_chain(tokens, num_blocks, block_size, parent, extra)
    digests = block_digests(token_ids, block_size, parent, scheme=scheme, seed=seed,
                            extra_keys=extra_keys, extra=extra)
    view = slice(-8, None) if scheme.startswith("vllm") else slice(0, 8)
    return np.array([int.from_bytes(d[view], "big") for d in digests], dtype=np.uint64)


def block_digests(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: bytes | None = None,
    *,
    scheme: str,
    seed: str | None = None,
    extra_keys: Sequence[tuple | None] | None = None,
    extra: object = None,
) -> list[bytes]:
    """The full block digests of an engine's scheme (see :func:`hash_blocks`): 32 bytes,
    16 for vLLM's xxhash schemes.

    Cost: one SHA-256 (or xxh3-128) per block over its serialised tokens.

    >>> d = block_digests([1] * 32, 16, scheme="sglang")
    >>> len(d), len(d[0]), block_digests([1] * 16, 16, d[0], scheme="sglang") == d[1:]
    (2, 32, True)
    """
    if scheme not in SCHEMES or scheme == "xxh3":
        raise ValueError(f"scheme={scheme!r}; pick one of {SCHEMES[1:]} (xxh3 has no digests)")
    if extra is not None:
        raise ValueError(f"extra= is for scheme='xxh3'; for {scheme!r} pass extra_keys= "
                         "(vLLM) or hash without a namespace (SGLang)")
    size = 16 if "xxhash" in scheme else 32
    if parent is not None and (not isinstance(parent, bytes | bytearray) or len(parent) != size):
        raise ValueError(f"parent={parent!r}; for scheme {scheme!r} pass the parent block's "
                         f"{size}-byte digest (block_digests), not its 64-bit event value")
    tokens, num_blocks = _blocks(token_ids, block_size, max_token=(1 << 63) - 1)
    if scheme == "sglang":
        if extra_keys is not None:
            raise ValueError("extra_keys= is for the vLLM schemes")
        if parent is None and seed is not None:  # SGLang's cache-salt namespace
            parent = hashlib.sha256(b"sglang-cache-salt-v1\0" + seed.encode()).digest()
        return _sglang_chain(tokens, num_blocks, block_size, parent)
    if extra_keys is not None and len(extra_keys) < num_blocks:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries; pass one per full block "
                         f"({num_blocks}), None where a block has none")
    return _vllm_chain(tokens, num_blocks, block_size, parent, scheme, seed, extra_keys)


def _blocks(token_ids, block_size: int, max_token: int = 0xFFFFFFFF) -> tuple[np.ndarray, int]:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise TypeError(f"token_ids must be a 1-D sequence of ints, got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > max_token):
        bound = "2**32" if max_token == 0xFFFFFFFF else "2**63"
        raise ValueError(f"token_ids must be in [0, {bound}); got a value outside that range")
    return tokens, tokens.size // block_size


def _xxh3_chain(tokens: np.ndarray, num_blocks: int, block_size: int, parent, extra) -> np.ndarray:
    data = tokens[: num_blocks * block_size].astype("<u4").tobytes()
    salt = extra.encode() if isinstance(extra, str) else (extra or b"")
    prev = 0 if parent is None else as_hash(parent)
    out = np.empty(num_blocks, dtype=np.uint64)
    step = 4 * block_size
    for i in range(num_blocks):
        prev = xxhash.xxh3_64_intdigest(
            prev.to_bytes(8, "little") + salt + data[i * step : (i + 1) * step]
        )
        out[i] = prev
    return out


def _vllm_chain(tokens, num_blocks, block_size, parent, scheme, seed, extra_keys) -> list[bytes]:
    import pickle

    import cbor2

    hash_bytes = xxhash.xxh3_128_digest if "xxhash" in scheme else (
        lambda data: hashlib.sha256(data).digest())
    if scheme.endswith("-cbor"):
        def digest(obj: object) -> bytes:
            return hash_bytes(cbor2.dumps(obj, canonical=True))
    else:
        def digest(obj: object) -> bytes:
            return hash_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        if extra_keys is not None:
            # pickle writes a string met twice in one tuple as a reference to the
            # first when it is the same object: intern them, so that keys equal in
            # value (decoded from JSON, say) pickle as vLLM's do (its tags are
            # literals), and JSON's lists as vLLM's tuples
            extra_keys = [None if keys is None else _interned(keys) for keys in extra_keys]

    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)
    prev = bytes(parent) if parent is not None else digest(seed)
    values = tokens[: num_blocks * block_size].tolist()  # Python ints: pickle must see ints
    out = []
    for i in range(num_blocks):
        keys = None if extra_keys is None else extra_keys[i]
        prev = digest((prev, tuple(values[i * block_size : (i + 1) * block_size]), keys))
        out.append(prev)
    return out


def _interned(value):
    """vLLM's form of extra keys decoded from anywhere: lists as tuples (JSON has no
    tuples; vLLM's keys are tuples), every str interned (equal strings one object).

    >>> _interned([["mm", "h1", 0]]) == (("mm", "h1", 0),)
    True
    """
    if isinstance(value, str):
        return sys.intern(value)
    if isinstance(value, tuple | list):
        return tuple(_interned(v) for v in value)
    return value


def _sglang_chain(tokens, num_blocks, block_size, parent) -> list[bytes]:
    prev = bytes(parent) if parent is not None else b""
    out = []
    for i in range(num_blocks):
        page = tokens[i * block_size : (i + 1) * block_size]
        if page.max(initial=0) > 0xFFFFFFFF:
            data = b"\xff" + page.astype("<u8").tobytes()  # SGLang's wide-token encoding
        else:
            data = page.astype("<u4").tobytes()
        prev = hashlib.sha256(prev + data).digest()
        out.append(prev)
    return out


def splitmix64(values: np.ndarray) -> np.ndarray:
    """A bijective, well-spread remix of uint64 values (the splitmix64 finaliser).

    For turning a trace's small sequential ids into hash-like values, and for
    sampling; distinct inputs stay distinct, so chained ids stay chained.

    >>> splitmix64(np.array([1, 2], np.uint64)).tolist() != [1, 2]
    True
    """
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
