"""py-lmdb's write transactions handed to C (`lmdb_env.raw_handle`, `lmdb_env.c`): taken
only where py-lmdb keeps them and only after the calls agree with py-lmdb's methods; a
failed check leaves the packer on the methods; liblmdb's errors are py-lmdb's."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest

import sarp
from sarp import lmdb_env, native

pytestmark = pytest.mark.skipif(
    not native.AVAILABLE, reason=f"sarp._native {native.WHY} (SARP_REQUIRE_NATIVE=1, as "
    "in CI, makes that a failure)")
KNOWN = lmdb.__version__.startswith("3.0.")  # the layout lmdb_env reads is py-lmdb 3.0's


@pytest.fixture
def checked():
    """The check's outcome put back after the test (tests below change it)."""
    if lmdb_env._raw is None:
        lmdb_env._check()
    before = lmdb_env._raw
    yield before
    lmdb_env._raw = before


@pytest.mark.skipif(not KNOWN, reason=f"lmdb {lmdb.__version__}: not the layout checked")
def test_both_bundled_engines_pass_the_check(checked):
    assert set(checked) == {(0, 9), (1, 0)}


@pytest.mark.parametrize("major", [0, 1])
def test_a_handle_is_given_only_where_everything_around_it_agrees(tmp_path, checked, major):
    if not checked:
        pytest.skip("liblmdb's calls are not used with this lmdb build")
    env = lmdb.open(str(tmp_path), max_dbs=2, lib_version=major)
    other = lmdb.open(str(tmp_path / "other"), max_dbs=2, lib_version=major)
    try:
        txn = env.begin(write=True)
        engine, handle = lmdb_env.raw_handle(txn, env)
        assert engine == checked[(major, 9 if major == 0 else 0)] and handle
        assert native.C.lmdb_txn(engine, handle)[0] == txn.id()
        assert lmdb_env.raw_handle(txn, other) is None  # not its environment
        with native.forced("python"):
            assert lmdb_env.raw_handle(txn, env) is None  # sarp's Python path
        child = env.begin(write=True, parent=txn)
        assert lmdb_env.raw_handle(child, env) is None  # its parent not named
        assert lmdb_env.raw_handle(child, env, parent=child) is None  # nor this one
        inner = lmdb_env.raw_handle(child, env, parent=txn)
        assert inner is not None and inner[1] != handle
        child.abort()
        assert lmdb_env.raw_handle(child, env, parent=txn) is None  # gone: no MDB_txn
        txn.commit()
        assert lmdb_env.raw_handle(txn, env) is None
    finally:
        env.close()
        other.close()


@pytest.mark.parametrize("how", ["disagrees", "raises"])
def test_a_failed_check_leaves_the_packer_on_py_lmdb(tmp_path, monkeypatch, checked, how):
    """Calls that answer otherwise than py-lmdb (or a check that raises) are never used:
    every C batch goes through py-lmdb's methods, and writes what it always wrote."""
    def agrees(major, engines):
        if how == "raises":
            raise OSError("no such symbol")
        return False

    monkeypatch.setattr(lmdb_env, "_agrees", agrees)
    lmdb_env._raw = None
    chain = np.arange(1, 200, dtype=np.uint64)
    with sarp.open(tmp_path / "ix", durability="nosync") as index, native.Tally() as tally:
        index.apply_batch([("insert", chain, None, "a", "GPU"),
                           ("remove", chain[150:][::-1], "a", "GPU")])
        assert index.match(chain).by_holder == {"a": 150}
    assert lmdb_env._raw == {}
    assert tally.c("pack_batch") > 0 and tally.c("lmdb_pack") == 0
    assert tally.python("lmdb_pack") == tally.c("pack_batch")


def test_a_full_map_met_by_liblmdb_calls_grows_it_as_py_lmdb_s_does(tmp_path, checked):
    """MDB_MAP_FULL in C's own put is py-lmdb's MapFullError: the store doubles the map
    and runs the write again, and every block lands."""
    if not checked:
        pytest.skip("liblmdb's calls are not used with this lmdb build")
    rng = np.random.default_rng(1)
    chains = [rng.integers(1, 1 << 62, 64, dtype=np.uint64) for _ in range(1500)]
    with sarp.open(tmp_path / "ix", durability="nosync", map_size_bytes=1 << 20) as index, \
            native.Tally() as tally:
        size = index._store.env.info()["map_size"]
        index.apply_batch([("insert", c, None, f"e{i % 3}", "GPU")
                           for i, c in enumerate(chains)])
        assert index._store.env.info()["map_size"] > size
        assert all(index.match(c).num_blocks == 64 for c in chains)
    assert tally.c("lmdb_pack") > 0 and tally.python("lmdb_pack") == 0


def test_raise_for_names_py_lmdb_s_class_and_the_code():
    with pytest.raises(lmdb.MapFullError, match="-30792"):
        lmdb_env.raise_for(-30792)
    with pytest.raises(lmdb.Error, match="12345"):
        lmdb_env.raise_for(12345)


@pytest.mark.parametrize("counter, value", [
    ("next_seg_id", b"\x01\x02\x03"),  # damaged
    ("next_seq", b"\x01"),  # damaged (the log's)
    ("next_seg_id", (0xFFFFFFFF - 4).to_bytes(8, "big")),  # every segment id taken
])
def test_the_counters_c_takes_fail_a_batch_as_python_s_do(tmp_path, checked, counter, value):
    """The segment ids and log sequence numbers C takes on the meta table: a damaged
    counter or the last id taken fails the batch with the error Python's path raises,
    and the index is as it was."""
    if not checked:
        pytest.skip("liblmdb's calls are not used with this lmdb build")
    errors = []
    for where in ("c", "python"):
        with sarp.open(tmp_path / where, durability="nosync") as index:
            index.apply_batch([("insert", np.arange(1, 9, dtype=np.uint64), None, "a", "GPU")])
            store = index._store
            with store.env.begin(write=True) as txn:
                kept = txn.get(counter.encode(), db=store.meta_db)
                txn.put(counter.encode(), value, db=store.meta_db)
            with native.forced(where), native.Tally() as tally, \
                    pytest.raises(sarp.SarpError) as caught:
                index.apply_batch([("insert", np.arange(20, 30, dtype=np.uint64), None, "b",
                                    "GPU")])
            assert tally.c("lmdb_pack") == (where == "c")
            assert index.match(np.arange(20, 30, dtype=np.uint64)).num_blocks == 0
            errors.append((type(caught.value), str(caught.value).replace(str(tmp_path / where),
                                                                         "IX")))
            with store.env.begin(write=True) as txn:  # (the close's snapshot reads them)
                txn.put(counter.encode(), kept, db=store.meta_db)
    assert errors[0] == errors[1]
    assert counter in errors[0][1] or "exhausted" in errors[0][1]


def _grow(path: str) -> None:
    """(another process) The map grown and filled past the size a reader opened."""
    env = lmdb.open(path, map_size=8 << 20, max_dbs=2)
    table = env.open_db(b"t")
    with env.begin(write=True) as txn:
        for i in range(3000):
            txn.put(i.to_bytes(8, "big"), bytes(1000), db=table)
    env.close()


def test_c_s_read_transaction_leaves_a_grown_map_to_py_lmdb(tmp_path, checked):
    """A writer elsewhere grew the map past a reader's: C's own read transaction says so
    (no read past the map), and once py-lmdb's begin has adopted the size, C reads on."""
    import multiprocessing as mp

    if not checked:
        pytest.skip("liblmdb's calls are not used with this lmdb build")
    env = lmdb.open(str(tmp_path), map_size=1 << 20, max_dbs=2)
    try:
        table = env.open_db(b"t")
        with env.begin(write=True) as txn:
            txn.put(b"k" * 8, b"v", db=table)
        engine, address, dbi = lmdb_env.raw_reads(env, (b"t",))
        assert native.C.lmdb_read_get(engine, address, dbi, b"k" * 8) == (0, b"v")
        grower = mp.get_context("spawn").Process(target=_grow, args=(str(tmp_path),))
        grower.start()
        grower.join(60)
        assert grower.exitcode == 0
        assert native.C.lmdb_read_get(engine, address, dbi, b"k" * 8)[0] == -30785  # resized
        with pytest.raises(lmdb.MapResizedError):
            env.begin()
        env.set_mapsize(0)  # what LmdbStore._begin does
        assert native.C.lmdb_read_get(engine, address, dbi, (2999).to_bytes(8, "big")) == (
            0, bytes(1000))
    finally:
        env.close()
