"""Index.batch / apply_batch: many writes in one transaction, the same result as one by
one, and a refused operation leaves no trace."""

from __future__ import annotations

import random

import pytest

import sarp


def random_ops(seed: int, count: int) -> list[tuple]:
    rng = random.Random(seed)
    chains: list[list[int]] = []
    ops = []
    for _ in range(count):
        holder = rng.choice(["a#0", "b#0", "c#1"])
        medium = rng.choice(["GPU", "CPU"])
        r = rng.random()
        if r < 0.5 or not chains:
            if chains and rng.random() < 0.6:
                base = rng.choice(chains)
                cut = rng.randrange(1, len(base) + 1)
                new = [rng.getrandbits(60) + 1 for _ in range(rng.randrange(1, 9))]
                ops.append(("insert", new, base[cut - 1], holder, medium))
                chains.append(base[:cut] + new)
            else:
                new = [rng.getrandbits(60) + 1 for _ in range(rng.randrange(1, 12))]
                ops.append(("insert", new, None, holder, medium))
                chains.append(new)
        elif r < 0.85:
            chain = rng.choice(chains)
            ops.append(("remove", chain[rng.randrange(len(chain)):], holder, medium))
        elif r < 0.93:
            ops.append(("clear", holder, rng.choice([None, medium])))
        else:
            ops.append(("insert", [rng.getrandbits(60) + 1], 12345, holder, medium))  # orphan
    return ops


def one_by_one(index, op) -> bool:
    try:
        if op[0] == "insert":
            index.insert(op[1], parent=op[2], holder=op[3], medium=op[4])
        elif op[0] == "remove":
            index.remove(op[1], holder=op[2], medium=op[3])
        else:
            index.clear(op[1], op[2])
        return True
    except (sarp.ParentNotFoundError, sarp.ChainConflictError):
        return False


@pytest.mark.parametrize("seed", range(6))
def test_batches_give_the_same_index_as_one_write_at_a_time(where, seed):
    ops = random_ops(seed, 400)
    rng = random.Random(seed)
    with sarp.open(where("single"), durability="nosync", segment_blocks=8) as single, \
            sarp.open(where("batched"), durability="nosync", segment_blocks=8) as batched:
        refused_single = [i for i, op in enumerate(ops) if not one_by_one(single, op)]
        refused_batched, i = [], 0
        while i < len(ops):
            n = rng.randrange(1, 60)
            result = batched.apply_batch(ops[i : i + n])
            refused_batched += [i + j for j, _ in result.failed]
            i += n
        assert refused_batched == refused_single
        for holder in ("a#0", "b#0", "c#1"):
            for medium in ("GPU", "CPU"):
                assert (batched.blocks_of(holder, medium).tolist()
                        == single.blocks_of(holder, medium).tolist())
        assert batched.check() == [] and single.check() == []
        assert batched.stats()["batches"] > 0
    with sarp.open(where("batched")) as reopened:  # and it recovers the same
        assert reopened.check() == []


def test_a_refused_operation_in_a_batch_leaves_no_trace(where):
    with sarp.open(where("ix")) as index:
        index.insert([1, 2, 3], holder="a")
        with index.batch() as b:
            b.insert([10, 11], holder="a")
            # 2 is stored after 1 at position 1: this claims it at 0 along with a new
            # block 50; refused whole, so 50 must not be stored either.
            b.insert([2, 50], holder="b")
            b.insert([12], parent=11, holder="a")
        assert [i for i, _ in b.result.failed] == [1]
        assert isinstance(b.result.failed[0][1], sarp.ChainConflictError)
        assert index.match([50]).num_blocks == 0 and index.blocks_of("b").size == 0
        assert index.match([10, 11, 12]).by_holder == {"a": 3}
        assert index.check() == []


def test_a_clear_in_a_batch_covers_what_the_same_batch_inserted(where):
    with sarp.open(where("ix")) as index:
        index.insert([1, 2], holder="a", medium="GPU")
        result = index.apply_batch([("insert", [3, 4], 2, "a", "GPU"),
                                    ("insert", [7], None, "new", "CPU"),
                                    ("clear", "a", None), ("clear", "new", "CPU"),
                                    ("insert", [1], None, "a", "CPU")])
        assert result.failed == [] and result.removed_per_op[2] == 4
        assert index.match([1, 2, 3, 4]).by_medium == {"a": {"CPU": 1}}
        assert index.match([7]).num_blocks == 0
        assert index.check() == []


def test_bad_arguments_are_reported_per_operation_or_raised_by_batch(where):
    with sarp.open(where("ix")) as index:
        result = index.apply_batch([("insert", [1, 1], None, "a", "GPU"),
                                    ("insert", [5], None, "a", "GPU"), ("nope",)])
        assert [i for i, _ in result.failed] == [0, 2]
        assert index.match([5]).num_blocks == 1
        with pytest.raises(ValueError, match="repeat"), index.batch() as b:
            b.insert([2, 2], holder="a")
        with index.batch() as b:
            pass
        assert b.result.failed == [] and b.result.operations == 0


def test_decoded_operations_apply_as_apply_batch_does(where):
    """The subscriber's entry (hashes already checked by the decoder) gives what
    apply_batch gives, and still refuses a bad holder name, per operation."""
    import numpy as np

    ops = [("insert", np.array([1, 2, 3], np.uint64), None, "a#0", "GPU"),
           ("insert", np.array([4], np.uint64), 3, "a#0", "CPU"),
           ("insert", np.array([9], np.uint64), None, "bad\0name", "GPU"),
           ("remove", np.array([3, 2], np.uint64), "a#0", "GPU"),
           ("insert", np.array([7], np.uint64), 777, "a#0", "GPU"),
           ("clear", "a#0", "CPU")]
    results = []
    for name, apply in (("decoded", "apply_decoded"), ("checked", "apply_batch")):
        with sarp.open(where(name)) as index:
            result = getattr(index, apply)(ops)
            results.append(([(i, type(e).__name__) for i, e in result.failed],
                            result.new_blocks, result.removed_per_op,
                            index.match([1, 2, 3, 4]).by_holder))
    assert results[0] == results[1]
    assert results[0][0] == [(2, "ValueError"), (4, "ParentNotFoundError")]


def engine_like_ops(seed: int, count: int) -> list[tuple]:
    """Stores that re-store parts of chains others hold and extend them, and removes
    in the orders engines evict (last block first), forwards, shuffled, with strays."""
    rng = random.Random(seed)
    chains: list[list[int]] = [[rng.getrandbits(60) + 1 for _ in range(rng.randrange(2, 12))]]
    ops: list[tuple] = [("insert", chains[0], None, "a#0", "GPU")]
    for _ in range(count):
        holder = rng.choice(["a#0", "b#0", "c#1"])
        medium = rng.choice(["GPU", "GPU", "CPU"])
        chain = rng.choice(chains)
        lo = rng.randrange(len(chain))
        r = rng.random()
        if r < 0.55:
            hi = rng.randrange(lo + 1, len(chain) + 1)
            new = [rng.getrandbits(60) + 1 for _ in range(rng.choice([0, 0, 1, 3, 9]))]
            if hi < len(chain) and new:
                chains.append(chain[:hi] + new)  # a branch off the middle
            elif new:
                chain.extend(new)
            ops.append(("insert", chain[lo:hi] + new, chain[lo - 1] if lo else None, holder,
                        medium))
        elif r < 0.9:
            blocks = chain[lo : lo + rng.randrange(1, 14)]
            order = rng.random()
            if order < 0.5:
                blocks = blocks[::-1]
            elif order < 0.65:
                rng.shuffle(blocks)
            if rng.random() < 0.2:
                blocks.insert(rng.randrange(len(blocks) + 1), rng.getrandbits(60) + 1)
            ops.append(("remove", blocks, holder, medium))
        elif r < 0.93:
            ops.append(("clear", holder, rng.choice([None, medium])))
        else:
            # Claims a stored block at another place: refused (a chain conflict).
            other = rng.choice(rng.choice(chains) + [None])
            if other != chain[lo]:
                ops.append(("insert", [chain[lo]], other, holder, medium))
    return ops


@pytest.mark.parametrize("seed", range(8))
def test_the_walking_write_path_equals_the_general_one(tmp_path, monkeypatch, seed):
    """Inserts that follow segments from the parent and removes that follow runs give
    exactly what looking every block up gives: same refusals, holdings, counts, layout.
    Both runs are Python's (the C batch has its own test against these)."""
    from sarp import native, packing

    ops = engine_like_ops(seed, 500)
    chunks = []
    rng = random.Random(seed)
    while sum(map(len, chunks)) < len(ops):
        start = sum(map(len, chunks))
        chunks.append(ops[start : start + rng.randrange(1, 40)])

    def run(path, walking: bool):
        monkeypatch.setattr(packing, "WALKING", walking)
        taken = dict(packing.TAKEN)
        with sarp.open(path, durability="nosync", segment_blocks=rng_blocks) as index, \
                native.forced("python"), native.Tally() as tally:
            refused, removed, start = [], [], 0
            for chunk in chunks:
                result = index.apply_batch(chunk)
                refused += [(start + i, type(e).__name__) for i, e in result.failed]
                removed += result.removed_per_op
                start += len(chunk)
            held = {(h, m): index.blocks_of(h, m).tolist()
                    for h in ("a#0", "b#0", "c#1") for m in ("GPU", "CPU")}
            stats = {k: index.stats()[k] for k in ("segments", "blocks", "directory_entries")}
            assert index.check() == []
        took = {k: packing.TAKEN[k] - taken[k] for k in taken}
        assert tally.c("pack_batch") == 0 and tally.python("pack_batch") > 0
        if walking:
            assert took["walk_insert"] > 0 and took["run_remove"] > 0, took
        else:
            assert took["walk_insert"] == took["run_remove"] == 0, took
        return refused, removed, held, stats

    rng_blocks = random.Random(seed).choice([1, 3, 8, 64])
    walked = run(tmp_path / "walk", True)
    general = run(tmp_path / "general", False)
    assert walked == general
    assert sum(walked[1]) > 0 and any(walked[2].values())  # the ops did something
