"""A writer's aliases in memory (``sarp.aliastable``): the C table held to its Python
reference, and on LMDB their dump and journal: read back at the next open, after a
compaction, after a write or a nested transaction that failed, from format 1, through
a SIGKILL at any point; a damaged record is named as damage."""

from __future__ import annotations

import os
import random
import signal
import struct
import time

import lmdb
import numpy as np
import pytest

from sarp import aliastable, native
from sarp.aliastable import Aliases, PyTable
from sarp.errors import DamagedIndexError
from sarp.store_lmdb import LmdbStore

U = np.uint64


def _tables() -> list:
    made = [PyTable()]
    if native.AVAILABLE:
        made.append(native._MODULE.AliasTable())
    return made


def _items(table) -> set[tuple[int, int, int]]:
    cols = [np.frombuffer(c, U).tolist() for c in table.items()]
    return set(zip(*cols, strict=True))


def _scan_round(table, count: int) -> list[tuple[int, int, int]]:
    seen, cursor = [], 0
    while True:
        r, h, k, cursor = table.scan(cursor, count)
        seen += zip(*(np.frombuffer(c, U).tolist() for c in (r, h, k)), strict=True)
        if cursor < 0:
            return seen


@pytest.mark.skipif(not native.AVAILABLE, reason="sarp._native is not built")
def test_the_c_table_does_what_its_reference_does():
    """Random puts (some overwriting, one root or one per alias), deletes (some of
    aliases not there) and lookups, through growth and many tombstones: the same
    answers, lengths and contents; a scan with no change between its steps meets every
    alias once."""
    rng = np.random.default_rng(5)
    py, c = PyTable(), native._MODULE.AliasTable()
    with native.Tally() as ran:
        for step in range(300):
            n = int(rng.integers(1, 400))
            roots = rng.integers(1, 4, n if step % 2 else 1).astype(U)
            hashes = rng.integers(0, 3000, n).astype(U)
            if step % 3 == 2:
                assert py.delete(roots, hashes) == c.delete(roots, hashes)
            else:
                keys = rng.integers(0, 1 << 63, n).astype(U)  # a pair twice: the later wins
                py.put(roots, hashes, keys)
                c.put(roots, hashes, keys)
            ask = rng.integers(0, 3500, 200).astype(U)
            root = np.array([int(rng.integers(1, 4))], U)
            assert py.get(root, ask) == c.get(root, ask)
            assert len(py) == len(c)
        assert _items(py) == _items(c)
        assert ran.c("alias_table") >= 600  # a change and a lookup a step
    for table in (py, c):
        for count in (1, 7, 1000):
            seen = _scan_round(table, count)
            assert len(seen) == len(table) and set(seen) == _items(table)
    c.clear()
    assert len(c) == 0 and c.get(np.array([1], U), np.array([5], U))[1] == b"\0"


def test_tables_refuse_columns_that_do_not_line_up():
    for table in _tables():
        with pytest.raises(ValueError):
            table.put(np.array([1, 2], U), np.array([1, 2, 3], U), np.array([1, 2, 3], U))
        with pytest.raises(ValueError):
            table.put(np.array([1], U), np.array([1, 2], U), np.array([1], U))
        assert len(table) == 0


def _store(path, **kw) -> LmdbStore:
    return LmdbStore(path, durability="nosync", **kw)


def _all(store: LmdbStore) -> set[tuple[int, int, int]]:
    r, h, k, _ = store.write(lambda w: w.alias_scan(None, 1 << 30))
    return set(zip(r.tolist(), h.tolist(), k.tolist(), strict=True))


def _change(w, rng: random.Random, model: dict) -> None:
    """A commit's worth of alias changes, applied to ``model`` too."""
    root = rng.randrange(1, 3)
    hashes = np.array(rng.sample(range(1, 5000), rng.randrange(1, 300)), U)
    if model and rng.random() < 0.3:
        gone = np.array([h for (r, h) in list(model)[:200] if r == root] + [9999], U)
        w.alias_delete(np.array([root], U), gone)
        for h in gone.tolist():
            model.pop((root, h), None)
        return
    keys = (hashes * U(3) + U(root)).astype(U)
    w.alias_put(np.full(hashes.size, root, U), hashes, keys)
    model.update(zip(((root, h) for h in hashes.tolist()), keys.tolist(), strict=True))


def _as_set(model: dict) -> set[tuple[int, int, int]]:
    return {(r, h, k) for (r, h), k in model.items()}


def test_aliases_are_read_back_at_the_next_open_across_compactions(tmp_path, monkeypatch):
    """Commits of puts and deletes, with the journal compacted into a dump several
    times: each reopen reads back exactly the aliases of the commits made; the table
    on disk holds dump records and a journal shorter than the bound."""
    monkeypatch.setattr(aliastable, "COMPACT_MIN", 500)
    rng, model = random.Random(1), {}
    for _round in range(4):
        store = _store(tmp_path)
        try:
            assert _all(store) == _as_set(model)
            for _ in range(30):
                store.write(lambda w: _change(w, rng, model))
            assert _all(store) == _as_set(model)
        finally:
            store.close()
    env = lmdb.open(str(tmp_path), readonly=True, lock=False, max_dbs=8)
    with env.begin() as txn:
        keys = [bytes(k) for k, _ in txn.cursor(db=env.open_db(b"aliases", txn=txn))]
    env.close()
    assert keys and keys[0][:1] == b"D"  # compacted at least once
    assert sum(k[:1] == b"J" for k in keys) < 30 * 4


def test_a_failed_write_or_nested_transaction_leaves_the_aliases_as_they_were(tmp_path):
    root, hashes, keys = np.array([7], U), np.array([1, 2, 3], U), np.array([10, 20, 30], U)
    store = _store(tmp_path)
    try:
        store.write(lambda w: w.alias_put(root, hashes[:1], keys[:1]))

        def fails(w):
            w.alias_put(root, hashes, keys)
            w.alias_delete(root, hashes[:1])
            assert w.alias_get(7, hashes)[1].tolist() == [False, True, True]  # seen inside
            raise RuntimeError("the write fails after its alias changes")

        with pytest.raises(RuntimeError):
            store.write(fails)
        assert _all(store) == {(7, 1, 10)}

        def nested(w):
            inner = w.nested()
            inner.alias_put(root, hashes[1:], keys[1:])
            inner.abort()
            w.alias_put(root, hashes[2:], keys[2:])

        store.write(nested)
        assert _all(store) == {(7, 1, 10), (7, 3, 30)}
    finally:
        store.close()
    store = _store(tmp_path)
    try:
        assert _all(store) == {(7, 1, 10), (7, 3, 30)}
    finally:
        store.close()


def _raw(path, edit) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        edit(txn, env.open_db(b"aliases", txn=txn), env.open_db(b"meta", txn=txn))
    env.close()


def test_an_index_of_format_1_has_its_aliases_moved_to_the_dump(tmp_path):
    """Format 1 kept an entry per alias (root + hash -> key, big-endian): a writer's
    open moves them to the dump and marks the index format 2; a reader's open changes
    nothing."""
    _store(tmp_path).close()
    old = {(5, h, h * 11) for h in range(1, 2000)} | {(6, 4, 44)}

    def to_v1(txn, aliases, meta):
        txn.drop(aliases, delete=False)
        for r, h, k in sorted(old):
            txn.put(struct.pack(">QQ", r, h), struct.pack(">Q", k), db=aliases)
        txn.put(b"format_version", struct.pack(">Q", 1), db=meta)

    _raw(tmp_path, to_v1)
    reader = LmdbStore(tmp_path, readonly=True)
    assert reader.format_version == 1
    with reader.read() as r:
        assert r.aliases_problems() == []  # format 1's entries, read as format 1
    reader.close()
    store = _store(tmp_path)
    try:
        assert store.format_version == 2
        assert _all(store) == old
        got, found = store.write(lambda w: w.alias_get(5, np.array([3, 5000], U)))
        assert found.tolist() == [True, False] and got.tolist() == [33, 0]
    finally:
        store.close()


def test_a_damaged_aliases_record_is_named_as_damage_by_a_write_and_by_verify(tmp_path):
    """A journal record that does not parse: the next write that needs the aliases
    refuses with DamagedIndexError naming repair, and ``Index.check`` (``sarp
    verify``) names it, on a reader's open and a writer's; before the damage, none."""
    import sarp

    store = _store(tmp_path)
    store.write(lambda w: w.alias_put(np.array([1], U), np.array([2, 3], U),
                                      np.array([4, 5], U)))
    store.close()
    for readonly in (True, False):
        with sarp.open(tmp_path, readonly=readonly) as index:
            assert index.check() == []
    _raw(tmp_path, lambda txn, aliases, meta: txn.put(b"J" + struct.pack(">Q", 1), b"P123",
                                                      db=aliases))
    for readonly in (True, False):
        with sarp.open(tmp_path, readonly=readonly) as index:
            problems = index.check()
            assert len(problems) == 1 and "aliases entry 4a" in problems[0], problems
            assert f"sarp repair {tmp_path}" in problems[0]
    store = _store(tmp_path)
    try:
        with pytest.raises(DamagedIndexError, match="sarp repair"):
            store.write(lambda w: w.alias_get(1, np.array([2], U)))
    finally:
        store.close()


def _child(path, commits: int, seed: int, report: int) -> None:
    aliastable.COMPACT_MIN = 400  # compactions within the run
    rng, model = random.Random(seed), {}
    store = _store(path)
    for n in range(commits):
        store.write(lambda w: _change(w, rng, model))
        os.write(report, struct.pack("<I", n + 1))


def test_a_writer_killed_at_any_point_leaves_the_aliases_of_its_commits(tmp_path):
    """A child commits alias changes (compacting now and then) and reports each commit
    after it returns; SIGKILL at a random moment.  Reopened, the aliases are those of
    the commits it reported, or of one more (killed between a commit and its report)."""
    rng = random.Random(11)
    for trial in range(6):
        path = tmp_path / f"t{trial}"
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                _child(path, 1 << 30, trial, write)  # until killed
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        time.sleep(rng.uniform(0.1, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        reported = 0
        while chunk := os.read(read, 4096):
            reported = struct.unpack("<I", chunk[-4:])[0] if len(chunk) >= 4 else reported
        os.close(read)
        replay, model = random.Random(trial), {}
        for _ in range(reported):
            _change(_Model(), replay, model)
        following = dict(model)
        _change(_Model(), replay, following)
        store = _store(path)
        try:
            got = _all(store)
        finally:
            store.close()
        assert reported > 50, "killed before it wrote much: give the child longer"
        assert got in (_as_set(model), _as_set(following)), (trial, reported)


class _Model:
    """A write that changes nothing, for replaying the child's choices."""

    def alias_put(self, *args) -> None:
        pass

    def alias_delete(self, *args) -> None:
        pass


def test_aliases_load_from_records_in_key_order():
    a = Aliases()
    a.load([])
    recs = [a.put(np.array([1], U), np.array([5, 6], U), np.array([50, 60], U)),
            a.delete(np.array([1], U), np.array([5], U))]
    b = Aliases()
    b.load(a.dump() + recs[1:])
    assert len(b) == 1 and b.get(1, np.array([5, 6], U))[0].tolist() == [0, 60]
