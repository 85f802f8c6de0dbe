"""Blocks keyed by their tokens, through the applier and the index, on both backends:
engines with other hash seeds share keys, a removal by engine hash removes, a store
without tokens resolves through the aliases, an unknown parent refuses, and two
models never share a block."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import sarp
from sarp import native
from sarp.serving.applier import Applier, ApplyStats
from sarp.serving.events import decode, encode_batch
from sarp.tokenkeys import model_root, token_keys

ROOT = model_root("llama")
TOKENS = list(range(100, 100 + 16 * 4))


def _feed(index, source: str, events: list[tuple], tokens: list, root: int = ROOT,
          stats: ApplyStats | None = None) -> ApplyStats:
    stats = stats or ApplyStats()
    applier = Applier(index)
    applier.add(source, decode(encode_batch(events, token_ids=tokens, dp_rank=0), True), stats,
                root=root)
    applier.flush()
    return stats


def _keys(tokens: list[int], root: int = ROOT) -> np.ndarray:
    return token_keys(tokens, 16, parent=root)[0]


def test_engines_with_other_hashes_share_token_keys(where):
    with sarp.open(where("ix"), durability="nosync") as index:
        _feed(index, "e0", [("stored", [11, 12, 13], None, "GPU")], [TOKENS[:48]])
        # another engine, another seed: other hashes for the same tokens, then one more
        _feed(index, "e1", [("stored", [21, 22], None, "GPU"), ("stored", [24], 22, "GPU")],
              [TOKENS[:32], TOKENS[32:48]])
        m = index.match(_keys(TOKENS))
        assert m.by_holder == {"e0#0": 3, "e1#0": 3}
        # the engine hashes themselves are not keys
        assert index.match([11, 12]).num_blocks == 0


def test_a_removal_by_engine_hash_removes_the_token_keyed_block(where):
    with sarp.open(where("ix"), durability="nosync") as index:
        _feed(index, "e0", [("stored", [11, 12, 13], None, "GPU")], [TOKENS[:48]])
        _feed(index, "e1", [("stored", [21, 22, 23], None, "GPU")], [TOKENS[:48]])
        stats = _feed(index, "e0", [("removed", [13, 99], "GPU")], [None])
        assert stats.blocks_removed == 1
        assert index.match(_keys(TOKENS)).by_holder == {"e0#0": 2, "e1#0": 3}
        _feed(index, "e1", [("cleared",)], [None])
        assert index.match(_keys(TOKENS)).by_holder == {"e0#0": 2}


def test_a_store_without_tokens_resolves_through_the_aliases(where):
    with sarp.open(where("ix"), durability="nosync") as index:
        _feed(index, "e0", [("stored", [11, 12, 13], None, "GPU")], [TOKENS[:48]])
        # an offload store: the same blocks to CPU, no tokens
        stats = _feed(index, "e0", [("stored", [11, 12], None, "CPU")], [[]])
        assert stats.blocks_stored == 2 and stats.skipped_orphans == 0
        assert index.match(_keys(TOKENS)).by_medium == {"e0#0": {"GPU": 3, "CPU": 2}}
        # blocks the aliases do not know: not stored, and, as for any refused store, the
        # engine's holders let go of its hashes (the index knows less, never more)
        stats = _feed(index, "e0", [("stored", [13, 77], 12, "CPU")], [[]])
        assert stats.skipped_orphans == 1
        assert index.match(_keys(TOKENS)).by_medium == {"e0#0": {"GPU": 2, "CPU": 2}}


def test_a_store_whose_parent_is_unknown_is_refused(where):
    with sarp.open(where("ix"), durability="nosync") as index:
        stats = _feed(index, "e0", [("stored", [12, 13], 999, "GPU")], [TOKENS[16:48]])
        assert stats.skipped_orphans == 1 and stats.blocks_stored == 0
        assert index.match(_keys(TOKENS)).num_blocks == 0
        # within one batch, a store's parent may be an earlier store of the batch
        stats = _feed(index, "e0", [("stored", [11], None, "GPU"), ("stored", [12], 11, "GPU")],
                      [TOKENS[:16], TOKENS[16:32]])
        assert stats.skipped_orphans == 0
        assert index.match(_keys(TOKENS)).by_holder == {"e0#0": 2}


def test_two_models_never_share_a_block(where):
    other = model_root("qwen")
    with sarp.open(where("ix"), durability="nosync") as index:
        # the same tokens and even the same engine hashes (vLLM's hashes leave the model out)
        _feed(index, "a", [("stored", [11, 12], None, "GPU")], [TOKENS[:32]])
        _feed(index, "b", [("stored", [11, 12, 13], None, "GPU")], [TOKENS[:48]], root=other)
        assert index.match(_keys(TOKENS)).by_holder == {"a#0": 2}
        assert index.match(_keys(TOKENS, other)).by_holder == {"b#0": 3}
        # a removal resolves within its own model
        _feed(index, "b", [("removed", [12], "GPU")], [None], root=other)
        assert index.match(_keys(TOKENS)).by_holder == {"a#0": 2}
        assert index.match(_keys(TOKENS, other)).by_holder == {"b#0": 1}


def test_token_keys_survive_a_restart(tmp_path):
    path = tmp_path / "ix"
    with sarp.open(path) as index:
        _feed(index, "e0", [("stored", [11, 12], None, "GPU")], [TOKENS[:32]])
        _feed(index, "e1", [("stored", [21, 22, 23], None, "GPU")], [TOKENS[:48]])
    with sarp.open(path) as index:
        # the aliases are on disk: a child of 12 and a removal of 11 resolve
        _feed(index, "e0", [("stored", [13], 12, "GPU"), ("removed", [11], "GPU")],
              [TOKENS[32:48], None])
        m = index.match(_keys(TOKENS), with_presence=True)
        assert m.num_blocks == 3 and m.presence[("e0#0", "GPU")].tolist() == [False, True, True]


@pytest.mark.parametrize("path", ["c", "python"])
def test_a_store_whose_extra_keys_hold_more_than_its_lora_is_not_keyed_by_tokens(path):
    """Blocks with an image or a cache salt are not named by their tokens alone: such a
    store is resolved through the aliases (and refused when they do not know it),
    never given the keys of the same tokens without the image."""
    if path == "c" and not native.AVAILABLE:
        pytest.skip(f"sarp._native {native.WHY}")
    tokens = list(range(32))
    base = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
            "token_ids": tokens, "block_size": 16}
    cases = [(None, None, True), ([None, None], None, True),
             ([["sql"], ["sql"]], "sql", True), ([["sql"], ["other"]], "sql", False),
             ([[["mm-1f3a", 0]], None], None, False), ([None, ["salt-7"]], None, False),
             ([["sql"], ["sql", "salt-7"]], "sql", False), ("junk", None, False)]
    for extra, lora, keyed in cases:
        event = {**base, "extra_keys": extra, "lora_name": lora}
        with native.forced(path):
            got = decode(msgpack.packb([0.0, [event], 0]), tokens=True).events[0]
        assert (got.token_ids is not None) == keyed, (extra, lora)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_random_streams_never_make_the_index_know_more_than_the_engines(where, seed):
    """Engines (two of them hashing with another seed) store chains with their tokens,
    offload some blocks to CPU without tokens, evict and clear, in random batches;
    after every batch each holder holds exactly the token keys of what its engine
    holds with tokens, and never a block its engine does not hold.  (It found the
    sweep taking an alias for dead when two seeds' hashes alias one key.)  The same
    stream resolved in Python (the reference of ``resolve_aliases``) gives the same
    index, batch by batch."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 1 << 17, size=16 * 6).tolist() for _ in range(4)]
    with sarp.open(where("ix"), durability="nosync") as index, \
            sarp.open(where("ix-python"), durability="nosync") as reference:
        engines = {f"e{i}": {"seed": 1 + (i >= 2), "GPU": {}, "CPU": {}} for i in range(4)}
        resolved_in = {"c": 0, "python": 0}
        for _ in range(40):
            applier, stats, in_python = Applier(index), ApplyStats(), Applier(reference)
            for name, eng in engines.items():
                events, tokens = [], []
                for _ in range(int(rng.integers(1, 4))):
                    r = rng.random()
                    if r < 0.5:  # a request: a prefix and a tail of its own
                        toks = prefixes[int(rng.integers(4))][: 16 * int(rng.integers(1, 7))]
                        toks = toks + rng.integers(0, 1 << 17, size=16 * int(
                            rng.integers(0, 3))).tolist()
                        keys = _keys(toks)
                        hashes = [int(k) ^ eng["seed"] for k in keys]  # chained, per seed
                        have = 0
                        while have < len(hashes) and hashes[have] in eng["GPU"]:
                            have += 1
                        if have < len(hashes):
                            events.append(("stored", hashes[have:],
                                           hashes[have - 1] if have else None, "GPU"))
                            tokens.append(toks[16 * have:])
                            eng["GPU"].update(zip(hashes, keys.tolist(), strict=True))
                    elif r < 0.7 and eng["GPU"]:  # evict a tail
                        gone = list(eng["GPU"])[-int(rng.integers(1, 4)):]
                        events.append(("removed", gone, "GPU"))
                        tokens.append(None)
                        for h in gone:
                            eng["GPU"].pop(h)
                    elif r < 0.9 and eng["GPU"]:  # offload a held root block, no tokens
                        roots = [h for h, k in eng["GPU"].items()
                                 if k in set(_keys(prefixes[0][:16]).tolist()
                                             + _keys(prefixes[1][:16]).tolist())]
                        if roots:
                            events.append(("stored", roots[:1], None, "CPU"))
                            tokens.append([])
                            eng["CPU"][roots[0]] = eng["GPU"][roots[0]]
                    elif r < 0.93:
                        events.append(("cleared",))
                        tokens.append(None)
                        eng["GPU"].clear()
                        eng["CPU"].clear()
                if events:
                    payload = encode_batch(events, token_ids=tokens, dp_rank=0)
                    applier.add(name, decode(payload, True), stats, root=ROOT)
                    in_python.add(name, decode(payload, True), ApplyStats(), root=ROOT)
            with native.Tally() as c_ran:
                applier.flush()
            with native.forced("python"), native.Tally() as python_ran:
                in_python.flush()
            assert c_ran.python("resolve_aliases") == python_ran.c("resolve_aliases") == 0
            resolved_in["c"] += c_ran.c("resolve_aliases")
            resolved_in["python"] += python_ran.python("resolve_aliases")
            for name, eng in engines.items():
                for medium in ("GPU", "CPU"):
                    held = set(index.blocks_of(f"{name}#0", medium).tolist())
                    assert held == set(reference.blocks_of(f"{name}#0", medium).tolist())
                    assert held <= set(eng[medium].values()), (name, medium)
                    if medium == "GPU":
                        assert held == set(eng[medium].values()), (name, stats)
        assert resolved_in["c"] >= 30 and resolved_in["python"] >= 30, resolved_in


def _aliases(index) -> int:
    return len(index._store.write(lambda w: w.alias_scan(None, 1 << 20)[0]))


def test_the_sweep_scales_with_the_batch_and_still_goes_round(where):
    """A cleared engine leaves 600 aliases behind; one-block commits each check only a
    few (SWEEP_MIN), not 512, and a run of them still finds every dead one."""
    from sarp.aliases import SWEEP_MIN

    tokens, other = list(range(7, 7 + 16 * 600)), list(range(10**6, 10**6 + 16 * 600))
    with sarp.open(where("ix"), durability="nosync") as index:
        _feed(index, "e0", [("stored", list(range(1000, 1600)), None, "GPU")], [tokens])
        _feed(index, "e0", [("cleared",)], [None])
        left = _aliases(index)  # the store's batch swept 512 live ones, the clear's 32
        assert left == 600
        _feed(index, "e1", [("stored", [5000], None, "GPU")], [other[:16]])
        # one block: about SWEEP_MIN checked (Valkey's HSCAN count is a hint), not 512
        assert _aliases(index) >= left + 1 - 2 * SWEEP_MIN
        n = 3 * 600 // SWEEP_MIN  # a little over two rounds of the table
        for k in range(1, n):
            _feed(index, "e1", [("stored", [5000 + k], 5000 + k - 1, "GPU")],
                  [other[16 * k : 16 * k + 16]])
        assert _aliases(index) == n  # e1's own, all alive
        assert index.match(_keys(other[: 16 * n])).by_holder == {"e1#0": n}


def test_the_sweep_slows_while_the_aliases_it_checks_live_and_not_once_they_die(
        where, monkeypatch):
    """While every alias it checks is alive (an index that only grows), the sweep
    checks a small part of its two per block named; once an engine is cleared, the
    first dead ones it meets bring it back to full pace, and it finds every dead one
    about as soon as before."""
    from sarp import store_lmdb, valkey_write
    from sarp.aliases import SWEEP_PER_BLOCK, SWEEP_SLOWEST

    checked: list[int] = []
    for cls in (store_lmdb.LmdbWriteTxn, valkey_write.ValkeyWriteTxn):
        def counting(self, cursor, count, scan=cls.alias_scan):
            got = scan(self, cursor, count)  # (roots, hashes, keys, cursor)
            checked.append(got[2].size)
            return got
        monkeypatch.setattr(cls, "alias_scan", counting)
    rng = np.random.default_rng(3)

    def hashes(n: int) -> list[int]:  # engines' hashes: spread over the table's keys
        return rng.integers(1, 1 << 62, n).tolist()

    with sarp.open(where("ix"), durability="nosync") as index:
        for k in range(40):  # 256 new blocks a commit, all of them alive
            if k == 30:
                checked.clear()
            _feed(index, "e0", [("stored", hashes(256), None, "GPU")],
                  [rng.integers(0, 1 << 17, 16 * 256).tolist()])
        assert sum(checked) < SWEEP_PER_BLOCK * 256 * 10 / 4  # was 512 a commit
        _feed(index, "e0", [("cleared",)], [None])
        assert _aliases(index) == 40 * 256  # all dead now
        tokens = rng.integers(0, 1 << 17, 16 * 64 * 200).tolist()
        commits, parent = 0, None
        while _aliases(index) > 64 * commits:  # e1's own are alive
            for _ in range(8):  # 64 blocks a commit: 128 checks at full pace
                chain = hashes(64)
                _feed(index, "e1", [("stored", chain, parent, "GPU")],
                      [tokens[16 * 64 * commits : 16 * 64 * (commits + 1)]])
                parent, commits = chain[-1], commits + 1
            if commits == 16:  # back to full pace at the first dead ones it met
                assert 40 * 256 + 64 * commits - _aliases(index) >= 16 * 128 / 2
            # the pace of before: 112 commits (the table goes round while e1 adds to it)
            assert commits < 1 / SWEEP_SLOWEST + 2 * 40 * 256 / 128, commits
        assert index.match(_keys(tokens[: 16 * 64 * commits])).by_holder == {
            "e1#0": 64 * commits}


def _sweep_lookups(monkeypatch) -> list[int]:
    """The blocks each sweep looks up (``WriteTxn.locate`` within ``aliases._sweep``)."""
    from sarp import aliases, store_lmdb, valkey_write

    asked: list[int] = []
    sweeping = [False]
    for cls in (store_lmdb.LmdbWriteTxn, valkey_write.ValkeyWriteTxn):
        def counting(self, hashes, locate=cls.locate):
            if sweeping[0]:
                asked.append(int(hashes.size))
            return locate(self, hashes)
        monkeypatch.setattr(cls, "locate", counting)

    def sweep(*args, real=aliases._sweep):
        sweeping[0] = True
        try:
            return real(*args)
        finally:
            sweeping[0] = False
    monkeypatch.setattr(aliases, "_sweep", sweep)
    return asked


def _two_engines(index, rng, commits: int, parent=None) -> int:
    """e1 stores 64 new blocks a commit (alive); the last hash."""
    for _ in range(commits):
        chain = rng.integers(1, 1 << 62, 64).tolist()
        _feed(index, "e1", [("stored", chain, parent, "GPU")],
              [rng.integers(0, 1 << 17, 16 * 64).tolist()])
        parent = chain[-1]
    return parent


@pytest.mark.parametrize("gone", ["cleared", "removed"])  # in Python, and in C
def test_the_sweep_looks_up_only_the_aliases_whose_block_left_and_finds_them_all(
        where, monkeypatch, gone):
    """A packer notes the blocks its writes delete; the sweep looks up only the aliases
    of those (none while all live), and still finds every dead one."""
    asked = _sweep_lookups(monkeypatch)
    rng = np.random.default_rng(5)
    with sarp.open(where("ix"), durability="nosync") as index:
        e0 = rng.integers(1, 1 << 62, 600).tolist()
        _feed(index, "e0", [("stored", e0, None, "GPU")],
              [rng.integers(0, 1 << 17, 16 * 600).tolist()])
        parent = _two_engines(index, rng, 10)
        assert sum(asked) == 0 and _aliases(index) == 600 + 640  # all alive: none looked up
        _feed(index, "e0", [("cleared",) if gone == "cleared" else ("removed", e0, "GPU")],
              [None])
        commits = 10
        while _aliases(index) > 64 * commits and commits < 400:
            parent = _two_engines(index, rng, 1, parent)
            commits += 1
        assert _aliases(index) == 64 * commits  # every dead one found
        assert 600 <= sum(asked) <= 600 + 64, sum(asked)  # and only those looked up


@pytest.mark.parametrize("unnoted", ["before the open", "past the note's bound"])
def test_aliases_that_died_unnoted_are_found_by_a_whole_round(tmp_path, monkeypatch, unnoted):
    """Blocks that left the index before the writer's open, or more of them than a
    packer keeps a note of: the sweep looks every alias up for a round, and finds them."""
    from sarp.writeset import Deaths

    rng = np.random.default_rng(6)
    monkeypatch.setattr(Deaths, "KEEP", 100)  # the clear's 600 are past it
    index = sarp.open(tmp_path / "ix", durability="nosync")
    try:
        _feed(index, "e0", [("stored", rng.integers(1, 1 << 62, 600).tolist(), None, "GPU")],
              [rng.integers(0, 1 << 17, 16 * 600).tolist()])
        parent = _two_engines(index, rng, 2)
        _feed(index, "e0", [("cleared",)], [None])
        assert _aliases(index) == 600 + 128
        if unnoted == "before the open":
            index.close()
            monkeypatch.undo()
            index = sarp.open(tmp_path / "ix", durability="nosync")
        commits = 2
        while _aliases(index) > 64 * commits and commits < 400:
            parent = _two_engines(index, rng, 1, parent)
            commits += 1
        assert _aliases(index) == 64 * commits
    finally:
        index.close()


def test_a_refused_store_leaves_its_hashes_aliases_to_the_stores_applied():
    """Which blocks' aliases a batch writes (``aliases._written``): those new to it;
    but when the packer refuses a store after its aliases were made, a hash it was
    the first to name is written from the next applied store that names it, so every
    applied store's blocks are written then."""
    from sarp.aliases import _written

    # store 0 (hashes a, b) named a first; store 1 (hashes a, c) names a again
    first = np.array([1, 1, 0, 1], bool)
    applied, sizes = np.array([True, True]), np.array([2, 2])
    assert _written(first, applied, sizes, np.array([False, False])).tolist() == \
        [True, True, False, True]
    assert _written(first, applied, sizes, np.array([True, False])).tolist() == \
        [False, False, True, True]  # a from store 1 now
    # a refused operation that was no applied store (a removal, say): the new ones
    assert _written(np.array([1, 1, 0, 0], bool), np.array([True, False]), sizes,
                    np.array([False, True])).tolist() == [True, True, False, False]
