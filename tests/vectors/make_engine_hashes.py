"""Produce tests/vectors/engine_hashes.json by running the engines' own hashing code.

Not run by the tests: it needs the engines' released wheels, which are large.  How
the committed file was made (Python 3.11, x86_64):

    pip download --no-deps vllm==0.11.0 vllm==0.33.0 sglang==0.5.23   (one at a time)
    unzip each wheel into WHEELS/<name>-<version>/
    g++ -O2 -shared -fPIC -std=c++17 $(python -m pybind11 --includes) \\
        WHEELS/sglang-0.5.23/sglang/srt/mem_cache/cpp_utils/hash_binding.cpp \\
        -DTORCH_EXTENSION_NAME=hicache_hash_cpp -lcrypto \\
        -o WHEELS/hicache_hash_cpp$(python3-config --extension-suffix)
    python tests/vectors/make_engine_hashes.py WHEELS > tests/vectors/engine_hashes.json

vLLM: ``hash_block_tokens``, ``init_none_hash`` (with ``resolve_none_hash_seed`` in
0.33), ``maybe_convert_block_hash`` and the ``sha256`` / ``sha256_cbor`` functions (and
0.33's ``xxhash`` / ``xxhash_cbor``, with tagged extra keys: ``vllm_more``) are
taken from the wheel's source files and executed as they are (the modules around
them import torch, so each function is compiled alone, with the names it uses).
SGLang: the ``hicache_hash_cpp`` extension built from the wheel's own C++ source,
called as ``get_native_hash`` calls it, and ``hash_str_to_int64`` from its source.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import random
import re
import sys
from array import array
from pathlib import Path

import cbor2


def functions(path: Path, names: set[str], namespace: dict) -> dict:
    """Compile the named top-level functions of a source file into ``namespace``."""
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = names - {n.name for n in body}
    if missing:
        raise SystemExit(f"{path}: no {sorted(missing)}")
    module = ast.Module(body=body, type_ignores=[])
    for node in body:
        node.returns = None  # annotations may name types we do not import
        for arg in node.args.args:
            arg.annotation = None
    exec(compile(module, str(path), "exec"), namespace)
    return namespace


class _Logger:
    def warning(self, *args, **kwargs) -> None:
        pass


class _Envs:
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True


def vllm(root: Path, version: str) -> list[dict]:
    kv = root / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    if version == "0.11.0":
        hashing = root / "vllm" / "utils" / "__init__.py"
    else:
        hashing = root / "vllm" / "utils" / "hashing.py"
    ns: dict = {"hashlib": hashlib, "pickle": pickle, "cbor2": cbor2, "os": os,
                "BlockHash": bytes, "logger": _Logger(), "envs": _Envs()}
    functions(hashing, {"sha256", "sha256_cbor"}, ns)
    ns["xxhash"] = ns["xxhash_cbor"] = object()
    ns["_NON_CRYPTO_HASH_FUNCTIONS"] = frozenset()
    ns["DEFAULT_NONE_HASH_SEED"] = "vllm-none-hash"
    names = {"hash_block_tokens", "init_none_hash", "maybe_convert_block_hash"}
    if version != "0.11.0":
        names.add("resolve_none_hash_seed")
    functions(kv, names, ns)
    rng = random.Random(7)
    out = []
    for algo in ("sha256", "sha256_cbor"):
        for seed in ("0", "12345", None):
            if seed is None and version == "0.11.0":
                continue  # 0.11 draws a random NONE_HASH without PYTHONHASHSEED
            for extra in (False, True):
                if seed is None:
                    os.environ.pop("PYTHONHASHSEED", None)
                else:
                    os.environ["PYTHONHASHSEED"] = seed
                ns["init_none_hash"](ns[algo])
                block_size = rng.choice([4, 16])
                tokens = [rng.randrange(200_000) for _ in range(block_size * 3 + block_size // 2)]
                keys = [("salt-a",), None, ("lora", "adapter-1")] if extra else None
                parent, hashes = None, []
                for i in range(len(tokens) // block_size):
                    block = tokens[i * block_size : (i + 1) * block_size]
                    parent = ns["hash_block_tokens"](ns[algo], parent, block,
                                                     None if keys is None else keys[i])
                    hashes.append(ns["maybe_convert_block_hash"](parent))
                out.append({"engine": f"vllm-{version}", "scheme": f"vllm-{algo}".replace(
                    "_", "-"), "seed": seed, "block_size": block_size, "tokens": tokens,
                    "extra_keys": keys, "hashes": hashes})
    os.environ.pop("PYTHONHASHSEED", None)
    return out


def vllm_more(root: Path, version: str) -> list[dict]:
    """vLLM 0.33's xxhash schemes, and all four with tagged extra keys as vLLM builds
    them (``("lora", name, path)``, ``("mm", identifier, offset)``: the tags are string
    literals in vLLM, so one object, which pickle writes once per block)."""
    import xxhash as xxhash_module

    kv = root / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    hashing = root / "vllm" / "utils" / "hashing.py"
    ns: dict = {"hashlib": hashlib, "pickle": pickle, "cbor2": cbor2, "os": os,
                "_xxhash": xxhash_module, "BlockHash": bytes, "logger": _Logger(),
                "envs": _Envs()}
    functions(hashing, {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "_xxhash_digest"}, ns)
    ns["_NON_CRYPTO_HASH_FUNCTIONS"] = frozenset({ns["xxhash"], ns["xxhash_cbor"]})
    ns["DEFAULT_NONE_HASH_SEED"] = "vllm-none-hash"
    functions(kv, {"hash_block_tokens", "init_none_hash", "maybe_convert_block_hash",
                   "resolve_none_hash_seed"}, ns)
    rng = random.Random(13)
    out = []
    tagged = [(("lora", "adapter-1", "/loras/a1"), ("mm", "img-a", 0), ("mm", "img-b", 3)),
              (("lora", "adapter-1", "/loras/a1"), ("mm", "img-b", -13)), None]
    for algo in ("xxhash", "xxhash_cbor", "sha256", "sha256_cbor"):
        for keys in ((None, [("salt-a",), None, ("lora", "adapter-1")], tagged)
                     if "xxhash" in algo else (tagged,)):
            os.environ["PYTHONHASHSEED"] = "0"  # xxhash draws a random seed without it
            ns["init_none_hash"](ns[algo])
            block_size = rng.choice([4, 16])
            tokens = [rng.randrange(200_000) for _ in range(block_size * 3 + 1)]
            parent, hashes = None, []
            for i in range(3):
                block = tokens[i * block_size : (i + 1) * block_size]
                parent = ns["hash_block_tokens"](ns[algo], parent, block,
                                                 None if keys is None else keys[i])
                hashes.append(ns["maybe_convert_block_hash"](parent))
            out.append({"engine": f"vllm-{version}", "scheme": f"vllm-{algo}".replace("_", "-"),
                        "seed": "0", "block_size": block_size, "tokens": tokens,
                        "extra_keys": keys, "hashes": hashes})
    os.environ.pop("PYTHONHASHSEED", None)
    return out


def sglang(root: Path, ext_dir: Path) -> list[dict]:
    sys.path.insert(0, str(ext_dir))
    import hicache_hash_cpp

    ns = functions(root / "sglang" / "srt" / "mem_cache" / "utils.py", {"hash_str_to_int64"}, {})
    rng = random.Random(11)
    out = []
    for block_size, wide in ((1, False), (16, False), (64, False), (16, True)):
        tokens = [rng.randrange(150_000) for _ in range(block_size * 4 + 3)]
        if wide:
            tokens[block_size + 2] = 2**40 + 5  # one page of tokens past uint32
        raw = array("q", tokens)
        hexes = hicache_hash_cpp.get_hash(raw, len(tokens), 1, False, None, block_size)
        full = len(tokens) // block_size
        out.append({"engine": "sglang-0.5.23", "scheme": "sglang", "seed": None,
                    "block_size": block_size, "tokens": tokens, "extra_keys": None,
                    "hashes": [ns["hash_str_to_int64"](h) for h in hexes[:full]]})
    return out


def sglang_namespaced(root: Path, ext_dir: Path) -> list[dict]:
    """SGLang's event hashes of pages under a LoRA adapter (``extra_key``) and a
    ``cache_salt``: ``compute_node_event_hash_values`` from its source, run on a radix
    node of one page chain, hashing with the extension as ``get_native_hash`` does."""
    sys.path.insert(0, str(ext_dir))
    import hicache_hash_cpp

    def get_hash_str(token_ids, prior_hash=None, page_size=None):
        prior = bytes.fromhex(prior_hash) if prior_hash else None
        raw = array("q", list(token_ids))
        return hicache_hash_cpp.get_hash(raw, len(raw), 1, False, prior, page_size)

    class Key(list):
        def __init__(self, tokens, extra_key, cache_salt):
            super().__init__(tokens)
            self.extra_key, self.cache_salt = extra_key, cache_salt

    class Node:
        def __init__(self, key, parent):
            self.key, self.parent = key, parent
            self.hash_value = self.event_hash_value = None

    ns = functions(root / "sglang" / "srt" / "mem_cache" / "utils.py",
                   {"hash_str_to_int64", "compute_node_event_hash_values",
                    "compute_node_hash_values", "get_storage_hash_str",
                    "storage_namespace_seed"},
                   {"hashlib": hashlib, "get_hash_str": get_hash_str, "List": list,
                    "Optional": None, "Any": object})
    rng = random.Random(12)
    out = []
    for block_size, extra_key, salt in ((16, "lora-7", None), (16, None, "tenant-a"),
                                        (4, "lora-7", "tenant-a"), (16, None, "")):
        tokens = [rng.randrange(150_000) for _ in range(block_size * 3 + 1)]
        full = len(tokens) // block_size
        root_node = Node(Key([], None, None), None)
        node = Node(Key(tokens[: full * block_size], extra_key, salt), root_node)
        hexes = ns["compute_node_event_hash_values"](node, block_size)
        out.append({"engine": "sglang-0.5.23", "scheme": "sglang", "seed": salt,
                    "block_size": block_size, "tokens": tokens, "extra_keys": None,
                    "lora_name": extra_key,
                    "hashes": [ns["hash_str_to_int64"](h) for h in hexes[:full]]})
    return out


def vllm_default_algo(root: Path) -> str:
    """The default of ``--prefix-caching-hash-algo``, as the wheel's config declares it."""
    text = (root / "vllm" / "config" / "cache.py").read_text()
    found = re.search(r'prefix_caching_hash_algo: PrefixCachingHashAlgo = "(\w+)"', text)
    if found is None:
        raise SystemExit(f"{root}: no prefix_caching_hash_algo default found")
    return found.group(1)


def main() -> None:
    wheels = Path(sys.argv[1])
    vectors = (vllm(wheels / "vllm-0.11.0", "0.11.0") + vllm(wheels / "vllm-0.33.0", "0.33.0")
               + sglang(wheels / "sglang-0.5.23", wheels)
               + sglang_namespaced(wheels / "sglang-0.5.23", wheels)
               + vllm_more(wheels / "vllm-0.33.0", "0.33.0"))
    json.dump({"made_by": "tests/vectors/make_engine_hashes.py (see its docstring)",
               "vllm_default_algo": {"vllm-0.33.0": vllm_default_algo(wheels / "vllm-0.33.0")},
               "vectors": vectors}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
