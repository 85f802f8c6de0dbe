"""Model-based test: sarp against a plain exact model, with restarts in between.

The universe is a fixed random tree of block ids (so chains share prefixes and
branch, and hashes are chained: an id sits at one position after one parent).
The model is, per (holder, medium), the set of blocks it holds; its answer for a
query is the plain prefix scan.  sarp must give exactly that answer, always.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import sarp

NUM_NODES = 40
HOLDERS = [("w0", "GPU"), ("w0", "CPU"), ("w1", "GPU"), ("w2", "DISK")]


def make_tree(seed: int) -> list[list[int]]:
    """Paths from the root to every node of a random tree; ids are large and unordered."""
    rng = random.Random(seed)
    ids = list({rng.getrandbits(64) | 1 for _ in range(NUM_NODES * 2)})[:NUM_NODES]
    parent = [-1] + [
        rng.randrange(0, i) if rng.random() < 0.3 else i - 1 for i in range(1, NUM_NODES)
    ]
    # a few independent roots too
    for i in rng.sample(range(1, NUM_NODES), 4):
        parent[i] = -1
    paths: list[list[int]] = []
    for node in range(NUM_NODES):
        path, cur = [], node
        while cur != -1:
            path.append(ids[cur])
            cur = parent[cur]
        paths.append(path[::-1])
    return paths


def model_match(held: dict, query: list[int]) -> tuple[int, dict[str, int]]:
    any_held = set().union(*held.values()) if held else set()
    n = 0
    while n < len(query) and query[n] in any_held:
        n += 1
    by_instance: dict[str, int] = {}
    for instance in {h for h, _ in held}:
        blocks = set().union(*(b for (h, _), b in held.items() if h == instance))
        k = 0
        while k < len(query) and query[k] in blocks:
            k += 1
        if k:
            by_instance[instance] = k
    return n, by_instance


def same_match(a: sarp.Match, b: sarp.Match) -> bool:
    """Equal answers, numpy arrays compared by value."""
    def same_arrays(x: dict, y: dict) -> bool:
        return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)

    return (a.num_blocks, a.by_holder, a.by_medium, a.storage_reads) == (
        b.num_blocks, b.by_holder, b.by_medium, b.storage_reads) and same_arrays(
        a.meta, b.meta) and same_arrays(a.presence, b.presence)


class SarpVsModel(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16), segment_blocks=st.sampled_from([1, 2, 3, 5, 16]))
    def setup(self, seed, segment_blocks):
        import tempfile

        self.tmp = tempfile.mkdtemp(prefix="sarp-model-")
        self.segment_blocks = segment_blocks
        self.paths = make_tree(seed)
        self.held: dict[tuple[str, str], set[int]] = {h: set() for h in HOLDERS}
        self.index = self.open_index()

    def open_index(self) -> sarp.Index:
        return sarp.open(self.tmp, segment_blocks=self.segment_blocks, durability="nosync",
                         snapshot_every_changes=7)

    def drop_snapshot(self) -> None:
        from sarp import snapshot

        snapshot.remove(self.index.path)

    def teardown(self):
        import shutil

        if hasattr(self, "index"):
            self.index.close()
        if hasattr(self, "tmp"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    def any_held(self) -> set[int]:
        return set().union(*self.held.values())

    @rule(node=st.integers(0, NUM_NODES - 1), holder=st.sampled_from(HOLDERS),
          cut=st.integers(0, 30), data=st.data())
    def insert(self, node, holder, cut, data):
        path = self.paths[node]
        start = min(cut, len(path) - 1)
        held = self.any_held()
        parent = path[start - 1] if start else None
        if parent is not None and parent not in held:
            try:
                self.index.insert(path[start:], parent=parent, holder=holder[0], medium=holder[1])
            except sarp.ParentNotFoundError:
                return
            raise AssertionError(f"insert after unheld parent {parent} was accepted")
        with_meta = data.draw(st.booleans())
        meta = [h % 1000 for h in path[start:]] if with_meta else None
        self.index.insert(path[start:], parent=parent, holder=holder[0], medium=holder[1],
                          meta=meta)
        self.held[holder].update(path[start:])

    @rule(node=st.integers(0, NUM_NODES - 1), holder=st.sampled_from(HOLDERS),
          lo=st.integers(0, 30), width=st.integers(1, 6),
          order=st.sampled_from(["forward", "last-first", "shuffled"]), seed=st.integers(0, 99))
    def remove(self, node, holder, lo, width, order, seed):
        path = self.paths[node]
        lo = min(lo, len(path) - 1)
        blocks = path[lo : lo + width]
        if order == "last-first":  # how engines evict a chain
            blocks = blocks[::-1]
        elif order == "shuffled":
            random.Random(seed).shuffle(blocks)
        removed = self.index.remove(blocks, holder=holder[0], medium=holder[1])
        assert removed == len(self.held[holder] & set(blocks))
        self.held[holder] -= set(blocks)

    @rule(holder=st.sampled_from(HOLDERS), all_media=st.booleans())
    def clear(self, holder, all_media):
        if all_media:
            self.index.clear(holder[0])
            for h in HOLDERS:
                if h[0] == holder[0]:
                    self.held[h] = set()
        else:
            self.index.clear(holder[0], medium=holder[1])
            self.held[holder] = set()

    @precondition(lambda self: hasattr(self, "index"))
    @invariant()
    def every_chain_matches_the_model(self):
        for path in self.paths:
            self.assert_same(path + [12345])

    @precondition(lambda self: hasattr(self, "index"))
    @invariant()
    def match_many_equals_match_request_by_request(self):
        # whole paths, paths cut short, paths with one block changed (a branch the
        # index does not have), and tails that start mid-path
        queries = [p + [12345] for p in self.paths]
        queries += [p[: len(p) // 2 + 1] for p in self.paths]
        queries += [p[:-1] + [p[-1] ^ 2] for p in self.paths if len(p) > 1]
        queries += [p[1:] for p in self.paths if len(p) > 1]
        many = self.index.match_many(queries, with_meta=True, with_presence=True)
        assert len(many) == len(queries)
        for query, got in zip(queries, many, strict=True):
            want = self.index.match(query, with_meta=True, with_presence=True)
            assert same_match(got, want), (query, got, want)

    def assert_same(self, query):
        m = self.index.match(query)
        n, by_instance = model_match(self.held, query)
        n = self.expected_total(query, n)
        assert m.num_blocks == n, (query, m, n)
        assert m.by_holder == by_instance, (m.by_holder, by_instance)
        for (instance, medium), blocks in self.held.items():
            k = 0
            while k < len(query) and query[k] in blocks:
                k += 1
            assert m.by_medium.get(instance, {}).get(medium, 0) == k

    def expected_total(self, query, n: int) -> int:
        """The model's ``num_blocks`` for ``query`` (``n``: the unsharded index's)."""
        return n

    @rule(kind=st.sampled_from(["close", "drop-snapshot", "snapshot-now"]))
    def restart(self, kind):
        if kind == "snapshot-now":
            self.index.snapshot()
        self.index.close()
        if kind == "drop-snapshot":
            self.drop_snapshot()
        self.index = self.open_index()

    @precondition(lambda self: hasattr(self, "index"))
    @invariant()
    def store_is_consistent(self):
        problems = self.index.check()
        assert problems == [], problems


SarpVsModel.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSarpVsModel = SarpVsModel.TestCase
