"""Token keys (sarp.tokenkeys): local hashes equal to those of Dynamo's standalone
indexer (vectors made by ai-dynamo-runtime 1.6.1's own code), keys that chain, and the
C path equal to the Python reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sarp import native, tokenkeys

VECTORS = json.loads((Path(__file__).parent / "vectors" / "dynamo_local_hashes.json").read_text())
PATHS = ["c", "python"] if native.AVAILABLE else ["python"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", VECTORS["cases"],
                         ids=lambda c: f"{c['block_size']}-{c['lora_name']}")
def test_local_hashes_are_dynamos(path, case):
    with native.Tally() as tally, native.forced(path):
        _, local = tokenkeys.token_keys(case["token_ids"], case["block_size"],
                                        parent=tokenkeys.model_root("m"),
                                        lora_name=case["lora_name"])
    assert local.tolist() == case["local_hashes"]
    assert (tally.c if path == "c" else tally.python)("token_keys") == 1


@pytest.mark.parametrize("path", PATHS)
def test_keys_chain_on_the_parent_and_name_the_whole_prefix(path):
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 1 << 32, size=16 * 50, dtype=np.uint64).astype(np.uint32)
    root = tokenkeys.model_root("llama")
    with native.forced(path):
        keys, local = tokenkeys.token_keys(tokens, 16, parent=root)
        # the second half, chained on the last key of the first: the same keys
        tail, _ = tokenkeys.token_keys(tokens[16 * 20:], 16, parent=int(keys[19]))
        again = tokenkeys.chain_locals(local, parent=root)
        # the same tokens after another first block: other keys, the same local hashes
        other = tokens.copy()
        other[0] ^= 1
        keys2, local2 = tokenkeys.token_keys(other, 16, parent=root)
    assert (tail == keys[20:]).all() and (again == keys).all()
    assert (local2[1:] == local[1:]).all() and not np.isin(keys2, keys).any()
    # another model, or another tenant: no key shared
    for root2 in (tokenkeys.model_root("qwen"), tokenkeys.model_root("llama", "team-b")):
        with native.forced(path):
            assert not np.isin(tokenkeys.token_keys(tokens, 16, parent=root2)[0], keys).any()


def test_c_equals_python_on_random_input():
    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}")
    rng = np.random.default_rng(9)
    for _ in range(50):
        size = int(rng.integers(1, 65))
        tokens = rng.integers(0, 1 << 32, size=int(rng.integers(0, 2000)), dtype=np.uint64)
        parent = int(rng.integers(0, 1 << 63))
        lora = [None, "a", "adapter-7"][int(rng.integers(0, 3))]
        with native.forced("c"):
            c = tokenkeys.token_keys(tokens, size, parent=parent, lora_name=lora)
        with native.forced("python"):
            p = tokenkeys.token_keys(tokens, size, parent=parent, lora_name=lora)
        for a, b in zip(c, p, strict=True):
            assert (a == b).all() and a.size == tokens.size // size


def test_a_bad_block_size_is_refused_naming_it():
    with pytest.raises(ValueError, match="block_size=0"):
        tokenkeys.token_keys([1, 2], 0, parent=0)
