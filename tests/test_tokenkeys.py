"""Token keys (sarp.tokenkeys): local hashes equal to those of Dynamo's standalone
indexer (vectors made by ai-dynamo-runtime 1.6.1's own code), keys that chain, and the
C path equal to the Python reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sarp import aliases, native, tokenkeys

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


def _resolve_model(kinds, roots, sizes, hashes, parents, has_parent, keys_of, stored):
    """``resolve_aliases``'s contract with a dict: the stored aliases and each store's
    made in order (the first one kept, and marked new), then the removals."""
    table = dict(stored)
    keys, found, first = [0] * len(hashes), [0] * len(hashes), [0] * len(hashes)
    made, parent_keys = [0] * len(kinds), [0] * len(kinds)
    starts = np.cumsum(sizes) - sizes
    for i, kind in enumerate(kinds):
        part = range(int(starts[i]), int(starts[i] + sizes[i]))
        if kind == 0:
            chain = roots[i]
            if has_parent[i]:
                if (roots[i], parents[i]) not in table:
                    continue
                chain = parent_keys[i] = table[roots[i], parents[i]]
            if keys_of[i] is not None:
                mine = keys_of[i](chain)
            elif all((roots[i], hashes[b]) in table for b in part):
                mine = [table[roots[i], hashes[b]] for b in part]
            else:
                continue
            made[i] = 1
            for b, k in zip(part, mine, strict=True):
                keys[b], found[b] = k, 1
                first[b] = int((roots[i], hashes[b]) not in table)
                table.setdefault((roots[i], hashes[b]), k)
    for i, kind in enumerate(kinds):
        if kind == 1:
            for b in range(int(starts[i]), int(starts[i] + sizes[i])):
                found[b] = int((roots[i], hashes[b]) in table)
                keys[b] = table.get((roots[i], hashes[b]), 0)
    return keys, found, made, parent_keys, first


def test_resolve_aliases_of_a_large_batch_is_its_contract():
    """A batch that makes tens of thousands of aliases (the C table grows from its
    first size many times over), with parents, stores without tokens, two model roots
    and removals of known and unknown hashes: ``resolve_aliases`` gives what a dict
    of the same aliases gives."""
    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}")
    rng = np.random.default_rng(11)
    roots_of = [tokenkeys.model_root("llama"), tokenkeys.model_root("qwen")]
    stored = {(roots_of[0], int(h)): int(rng.integers(1, 1 << 63))
              for h in rng.integers(1, 1 << 40, size=300)}
    pool = [h for _, h in stored]
    kinds, roots, sizes, hashes, parents, has_parent, tokens, counts, seeds = \
        [], [], [], [], [], [], [], [], []
    keys_of = []
    for _ in range(3000):
        root = roots_of[int(rng.integers(2))]
        n = int(rng.integers(1, 20))
        if rng.random() < 0.3:  # a removal: known hashes and others
            kinds.append(1)
            picked = [pool[int(j)] for j in rng.integers(0, len(pool), size=n)]
            picked = [h if rng.random() < 0.7 else int(rng.integers(1, 1 << 40))
                      for h in picked]
            hashes += picked
            parents.append(0), has_parent.append(0), counts.append(0), keys_of.append(None)
        else:
            kinds.append(0)
            with_parent = rng.random() < 0.6
            parents.append(pool[int(rng.integers(len(pool)))] if with_parent else 0)
            has_parent.append(int(with_parent))
            if rng.random() < 0.1:  # no tokens: resolved through the aliases
                hashes += [pool[int(j)] for j in rng.integers(0, len(pool), size=n)]
                counts.append(0), keys_of.append(None)
            else:
                new = rng.integers(1, 1 << 40, size=n).tolist()
                hashes += new
                pool += new
                toks = rng.integers(0, 1 << 17, size=16 * n).astype(np.uint32)
                tokens.append(toks)
                counts.append(16 * n)
                keys_of.append(lambda chain, toks=toks:
                               tokenkeys.token_keys(toks, 16, parent=int(chain))[0].tolist())
        roots.append(root), sizes.append(n), seeds.append(tokenkeys.lora_seed(None))
    kinds_a = np.array(kinds, np.uint8)
    kinds_blocks = np.repeat(kinds_a == 0, sizes).tolist()  # a store's block?
    args = (kinds_a, np.array(roots, np.uint64), np.array(sizes, np.int64),
            np.array(hashes, np.uint64), np.array(parents, np.uint64),
            np.array(has_parent, np.uint8), np.concatenate(tokens),
            np.array(counts, np.int64), np.array([16 if c else 0 for c in counts], np.int64),
            np.array(seeds, np.uint64), np.array([r for r, _ in stored], np.uint64),
            np.array([h for _, h in stored], np.uint64),
            np.array(list(stored.values()), np.uint64))
    keys, found, made, parent_keys, first = native.C.resolve_aliases(*args)
    want = _resolve_model(kinds, roots, sizes, hashes, parents, has_parent, keys_of, stored)
    assert np.frombuffer(found, np.uint8).tolist() == want[1]
    got = np.frombuffer(keys, np.uint64).tolist()  # a key means something where found
    assert [k for k, f in zip(got, want[1], strict=True) if f] == \
        [k for k, f in zip(want[0], want[1], strict=True) if f]
    assert np.frombuffer(made, np.uint8).tolist() == want[2]
    assert np.frombuffer(parent_keys, np.uint64).tolist() == want[3]
    assert np.frombuffer(first, np.uint8).tolist() == want[4]  # the aliases to write
    assert 0 < sum(want[4]) < sum(f for f, k in zip(want[1], kinds_blocks, strict=True) if k)
    assert sum(want[2]) > 1000 and sum(want[1]) > 10000  # stores made, blocks resolved


def test_resolve_aliases_remembers_nothing_from_the_call_before():
    """The C table's slots are kept from call to call: a call after a large one finds
    none of the aliases the large one made, and the large one again gives what it gave,
    before and after the kept slots are handed back."""
    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}")
    rng = np.random.default_rng(5)
    root = tokenkeys.model_root("llama")
    n = 40_000  # stores of 8 blocks: the table doubles from 1024 slots to 128 Ki
    hashes = rng.integers(1, 1 << 40, size=n).astype(np.uint64)
    tokens = rng.integers(0, 1 << 17, size=16 * n).astype(np.uint32)
    ops = n // 8
    none = np.zeros(0, np.uint64)

    def stores():
        return native.C.resolve_aliases(
            np.zeros(ops, np.uint8), np.full(ops, root, np.uint64), np.full(ops, 8, np.int64),
            hashes, np.zeros(ops, np.uint64), np.zeros(ops, np.uint8), tokens,
            np.full(ops, 128, np.int64), np.full(ops, 16, np.int64),
            np.full(ops, tokenkeys.lora_seed(None), np.uint64), none, none, none)

    first = stores()
    assert np.frombuffer(first[1], np.uint8).all() and np.frombuffer(first[2], np.uint8).all()
    asked = hashes[::97].copy()  # removals (kind 1) of blocks the call before made
    _, found, *_ = native.C.resolve_aliases(
        np.ones(1, np.uint8), np.full(1, root, np.uint64), np.full(1, asked.size, np.int64),
        asked, np.zeros(1, np.uint64), np.zeros(1, np.uint8), np.zeros(0, np.uint32),
        np.zeros(1, np.int64), np.zeros(1, np.int64),
        np.full(1, tokenkeys.lora_seed(None), np.uint64), none, none, none)
    assert not np.frombuffer(found, np.uint8).any()
    assert stores() == first
    assert aliases.release() >= 128 * 1024 * 24  # handed back (serve's idle trim) ...
    assert aliases.release() == 0
    assert stores() == first  # ... and mapped again by the next call


def test_serves_idle_trim_hands_back_the_kept_table():
    if not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}")
    from sarp.serving import serve

    def one_store():  # of one block, its tokens given
        none = np.zeros(0, np.uint64)
        native.C.resolve_aliases(
            np.zeros(1, np.uint8), np.ones(1, np.uint64), np.ones(1, np.int64),
            np.full(1, 7, np.uint64), np.zeros(1, np.uint64), np.zeros(1, np.uint8),
            np.arange(16, dtype=np.uint32), np.full(1, 16, np.int64), np.full(1, 16, np.int64),
            np.zeros(1, np.uint64), none, none, none)

    one_store()
    assert aliases.release() > 0 and aliases.release() == 0  # a call keeps its table
    one_store()
    serve._trim_malloc()
    assert aliases.release() == 0  # serve's idle trim handed it back
