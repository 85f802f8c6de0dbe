"""The batch write in C (`packing.c`) against Packer's Python, byte for byte: the same
tables on disk, the same answers, the same refusals and errors; each run asserts which
path it took (`sarp.native.Tally`)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_batch import engine_like_ops, random_ops

import sarp
from sarp import lmdb_env, native, packing
from sarp.errors import CorruptRecordError

pytestmark = pytest.mark.skipif(
    not native.AVAILABLE, reason=f"sarp._native {native.WHY} (SARP_REQUIRE_NATIVE=1, as "
    "in CI, makes that a failure); the Python path is what every other test runs then")


class _Spy:
    """The extension with its ``pack_batch`` watched: (operations done in C or None for
    a deferred run the table refused, operations, deferred) per call."""

    def __init__(self, real, calls: list, probes: list | None) -> None:
        self._real, self._calls, self._probes = real, calls, probes

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def pack_batch(self, ctx, ops, *args):
        out = self._real.pack_batch(ctx, ops, *args)
        self._calls.append((None if out is None else out[0], len(ops), args[-1]))
        if self._probes is not None:  # ctx ends (..., the directory's sorted probe, raw)
            self._probes.append(ctx[-2] is not None)
        return out

TABLES = ("segments_db", "blocks_db", "log_db", "holders_db")


def _state(index) -> dict:
    """Every table but the index's own id, the directory and the holder filters."""
    store = index._store
    with store.env.begin() as txn:
        tables = {name: list(txn.cursor(db=getattr(store, name))) for name in TABLES}
        tables["meta"] = [kv for kv in txn.cursor(db=store.meta_db) if kv[0] != b"index_id"]
    tables["directory"] = index.directory.entries()
    tables["filters"] = {h: sorted(s) for h, s in index.holders.as_sets().items() if s}
    return tables


def _run(path, chunks, in_c: bool, segment_blocks: int, before=None, deferred_min=None,
         raw: bool = True, compact: bool = False, probes: list | None = None):
    """Apply ``chunks`` in C (``in_c``; deferred from ``deferred_min`` operations on
    when given; on liblmdb's own calls unless not ``raw``: then on py-lmdb's methods)
    or in Python; with ``compact``, the directory's changes merged into its sorted
    arrays after every third chunk.  ``calls`` has (operations done in C or None for a
    deferred run the table refused, operations, deferred) per C call; ``probes``, if
    given, whether C was given the directory's sorted probe, per C call."""
    calls: list = []
    raw = raw and _raw_available()  # (without them, the methods: as asserted below)
    checked = lmdb_env._raw
    with sarp.open(path, durability="nosync", segment_blocks=segment_blocks) as index:
        if before is not None:
            before(index)
        default_min = packing.DEFERRED_MIN_OPS
        if deferred_min is not None:
            packing.DEFERRED_MIN_OPS = deferred_min
        if not raw:
            lmdb_env._raw = {}  # no engine checked: py-lmdb's methods
        try:
            answers = []
            with native.forced("c" if in_c else "python"), native.Tally() as tally:
                if in_c:
                    native.C = _Spy(native.C, calls, probes)  # put back as forced() ends
                for k, chunk in enumerate(chunks):
                    result = index.apply_batch(chunk)
                    if compact and k % 3 == 2:  # (between merges, what was removed since)
                        index.directory.compact()
                    answers.append((result.new_blocks, result.removed_per_op,
                                    [(i, type(e).__name__, str(e).replace(str(path), "IX"))
                                     for i, e in result.failed]))
        finally:
            packing.DEFERRED_MIN_OPS = default_min
            lmdb_env._raw = checked
        if in_c:
            assert tally.c("pack_batch") == len(calls) > 0
            # every C batch on liblmdb's calls, or every one on py-lmdb's methods
            assert tally.c("lmdb_pack") == (len(calls) if raw else 0)
            assert tally.python("lmdb_pack") == (0 if raw else len(calls))
        else:
            assert tally.c("pack_batch") == 0 and tally.python("pack_batch") > 0
        assert index.check() == []
        return answers, _state(index), calls


def _raw_available() -> bool:
    """Whether this process's lmdb build passed the check of liblmdb's calls."""
    if lmdb_env._raw is None:
        lmdb_env._check()
    return bool(lmdb_env._raw)


def _chunks(ops, seed):
    rng = random.Random(seed)
    chunks, at = [], 0
    while at < len(ops):
        size = rng.choice([1, 5, 20, 60])
        chunks.append(ops[at : at + size])
        at += size
    return chunks


@pytest.mark.parametrize("raw", [True, False], ids=["liblmdb", "py-lmdb"])
@pytest.mark.parametrize("deferred", [False, True], ids=["direct", "deferred"])
@pytest.mark.parametrize("seed", range(8))
def test_c_batches_write_what_python_batches_write(tmp_path, seed, deferred, raw):
    """Engine-like streams (re-stores, branches, evictions last block first, strays,
    clears, conflicts) at several segment sizes: every table equal, byte for byte;
    with each batch's ``blocks`` writes deferred to its end too, including batches the
    table refuses there and that run again; C reading and writing through liblmdb's
    own calls and through py-lmdb's methods alike."""
    if raw and not _raw_available():
        pytest.skip("liblmdb's calls are not used with this lmdb build (lmdb_env._check)")
    ops = engine_like_ops(seed, 600) if seed % 2 else random_ops(seed, 600)
    chunks = _chunks(ops, seed)
    blocks = [1, 3, 8, 64][seed % 4]
    c_answers, c_state, calls = _run(tmp_path / "c", chunks, True, blocks,
                                     deferred_min=1 if deferred else None, raw=raw)
    py_answers, py_state, _ = _run(tmp_path / "py", chunks, False, blocks)
    assert c_answers == py_answers
    assert c_state == py_state
    ran = [(done, size) for done, size, _ in calls if done is not None]
    assert sum(done for done, _ in ran) > len(ops) // 5  # C did a good part
    assert any(done == size > 1 for done, size in ran)  # whole batches
    assert any(0 < done < size for done, size in ran)  # and handed some over midway
    assert any(refused for _, _, refused in c_answers)
    assert any(d and done is not None for done, _, d in calls) == deferred


@pytest.mark.parametrize("deferred", [False, True], ids=["direct", "deferred"])
@pytest.mark.parametrize("seed", range(4))
def test_c_batches_over_a_merged_directory_write_what_python_batches_write(tmp_path, seed,
                                                                           deferred):
    """The directory merged into its sorted arrays after every third batch, so that C's
    lookups end in the arrays and the set of hashes removed since instead of the
    Python lookup's: every table equal to Python's, byte for byte, directory included."""
    ops = engine_like_ops(seed, 600) if seed % 2 else random_ops(seed, 600)
    chunks = _chunks(ops, seed)
    blocks = [1, 3, 8, 64][seed % 4]
    probes: list[bool] = []
    c_answers, c_state, calls = _run(tmp_path / "c", chunks, True, blocks, compact=True,
                                     deferred_min=1 if deferred else None, probes=probes)
    py_answers, py_state, _ = _run(tmp_path / "py", chunks, False, blocks, compact=True)
    assert probes and all(probes)
    assert c_answers == py_answers
    assert c_state == py_state
    assert c_state["directory"] and sum(done or 0 for done, _, _ in calls) > len(ops) // 5


@pytest.mark.parametrize("where", ["kept", "dead"])
def test_a_deferred_claim_the_table_refuses_runs_the_batch_again(tmp_path, where):
    """A new block the table already has (stored after another parent) is seen only at
    the deferred batch's end, also when its segment died in the same batch: the nested
    transaction is dropped and the batch runs again undeferred, as Python runs it."""
    first = [("insert", np.array([1, 2, 3], dtype=np.uint64), None, "a", "GPU")]
    batch = [("insert", np.array([10, 11], dtype=np.uint64), None, "b", "GPU"),
             ("insert", np.array([2], dtype=np.uint64), 11, "b", "GPU"),
             ("insert", np.array([7, 8], dtype=np.uint64), None, "c", "GPU")]
    if where == "dead":
        batch.append(("remove", np.array([2, 11, 10], dtype=np.uint64), "b", "GPU"))
    c_answers, c_state, calls = _run(tmp_path / "c", [first, batch], True, 8,
                                     deferred_min=1)
    py_answers, py_state, _ = _run(tmp_path / "py", [first, batch], False, 8)
    assert (c_answers, c_state) == (py_answers, py_state)
    assert calls[1] == (None, len(batch), True)  # refused at the end
    assert calls[2][2] is False  # and run again
    assert c_answers[1][2]  # the conflicting insert failed, as in Python


@pytest.mark.parametrize("deferred", [False, True], ids=["direct", "deferred"])
@pytest.mark.parametrize("segment_blocks", [1, 3])
def test_a_store_over_an_evicted_block_whose_child_is_held_stays_in_c(
        tmp_path, segment_blocks, deferred):
    """A chain stored again after a block in its middle left the index while the
    block after it (the first of its own segment) stayed: the new blocks end at that
    child and the walk goes on from it, in C as in Python, with no handover; the
    holder is back on the whole chain.  Deferred, the table's refusal is seen at the
    end and the batch runs again undeferred (the refusal that ends the new run)."""
    chain = np.arange(100, 110, dtype=np.uint64)
    first = [("insert", chain, None, "a", "GPU"), ("insert", chain[:7], None, "b", "GPU")]
    evict = [("remove", chain[3:6], "a", "GPU"), ("remove", chain[3:7], "b", "GPU")]
    again = [("insert", chain, None, "a", "GPU"), ("insert", np.array([5, 6], np.uint64),
                                                    None, "c", "GPU")]
    chunks = [first, evict, again]
    c_answers, c_state, calls = _run(tmp_path / "c", chunks, True, segment_blocks,
                                     deferred_min=1 if deferred else None)
    py_answers, py_state, _ = _run(tmp_path / "py", chunks, False, segment_blocks)
    assert (c_answers, c_state) == (py_answers, py_state)
    assert calls[-1] == (len(again), len(again), False)  # the whole batch in C
    assert [c for c in calls if c[2]] == ([(2, 2, True), (2, 2, True), (None, 2, True)]
                                          if deferred else [])
    assert c_answers[-1] == (3 + 2, [0, 0], [])  # chain[3:6] new again, no refusal
    with sarp.open(tmp_path / "c") as index:
        assert index.match(chain).by_holder == {"a": 10, "b": 3}


def test_deferred_batches_of_an_engine_stream_keep_every_table(tmp_path):
    """Chunks of 200 operations (deferred at the default threshold) of a long engine-like
    stream: the same tables as Python's, every batch run deferred and most kept (the
    stream stores some blocks again after another parent: those batches run again)."""
    ops = engine_like_ops(11, 3000)
    chunks = [ops[i : i + 200] for i in range(0, len(ops), 200)]
    c_answers, c_state, calls = _run(tmp_path / "c", chunks, True, 16)
    py_answers, py_state, _ = _run(tmp_path / "py", chunks, False, 16)
    assert (c_answers, c_state) == (py_answers, py_state)
    assert len(chunks[0]) >= packing.DEFERRED_MIN_OPS
    kept = [done is not None for done, _, deferred in calls if deferred]
    assert len(kept) == len(chunks) and sum(kept) >= len(chunks) // 2, kept


@pytest.mark.parametrize("deferred", [False, True], ids=["direct", "deferred"])
def test_segments_with_meta_keep_it_through_c_batches(tmp_path, deferred):
    """Records written with meta (Index.insert's) are carried through: appends, splits,
    removes and dropped rows keep each holder's values where Python keeps them."""
    rng = np.random.default_rng(3)
    chain = rng.integers(1, 1 << 62, 40, dtype=np.uint64)

    def before(index):
        index.insert(chain[:20], holder="a", meta=np.arange(20))
        index.insert(chain[:12], holder="b", meta=np.arange(100, 112))

    ops = [("insert", chain[20:30], int(chain[19]), "b", "GPU"),
           ("remove", chain[8:12][::-1], "b", "GPU"),
           ("insert", rng.integers(1, 1 << 62, 3, dtype=np.uint64), int(chain[15]), "c", "GPU"),
           ("remove", chain[:20][::-1], "a", "GPU"),
           ("insert", chain[30:40], int(chain[29]), "a", "CPU")]
    c = _run(tmp_path / "c", [ops], True, 64, before, deferred_min=1 if deferred else None)
    py = _run(tmp_path / "py", [ops], False, 64, before)
    assert c[:2] == py[:2]
    assert c[2][-1] == (len(ops), len(ops), deferred)


def test_a_damaged_record_fails_the_batch_as_python_does(tmp_path, monkeypatch):
    chain = np.arange(1, 9, dtype=np.uint64)
    errors = []
    monkeypatch.setattr(packing, "DEFERRED_MIN_OPS", 2)  # the first run is deferred
    for in_c in (True, False):
        with sarp.open(tmp_path / str(in_c), durability="nosync") as index:
            index.insert(chain, holder="a")
            seg_id = index.directory.lookup(1)
            store = index._store
            with store.env.begin(write=True) as txn:
                key = seg_id.to_bytes(8, "big")
                record = bytearray(txn.get(key, db=store.segments_db))
                record[30] ^= 1
                txn.put(key, bytes(record), db=store.segments_db)
            before = _state(index)
            with native.forced("c" if in_c else "python"), native.Tally() as tally, \
                    pytest.raises(CorruptRecordError) as caught:
                index.apply_batch([("insert", [20, 21], None, "b", "GPU"),
                                   ("remove", chain[4:], "a", "GPU")])
            assert (tally.c("pack_batch") > 0) == in_c != (tally.python("pack_batch") > 0)
            errors.append(str(caught.value).replace(str(tmp_path / str(in_c)), "IX"))
            assert _state(index) == before  # nothing of the batch applied
    assert errors[0] == errors[1]


def test_the_c_blocks_table_of_a_valkey_write_answers_as_its_python_reference():
    """``BlockTable`` (a write's ``blocks`` on Valkey, read and changed by pack_batch in
    C) against ``BlockView``, its Python reference, under the same random loads, puts,
    deletes and fetches: the same lookups, the same hashes wanted, and the same changes
    for the commit (a delete of an entry the server never had left out)."""
    from sarp.valkey_write import BlockView

    rng = np.random.default_rng(5)
    server = {int(h): bytes(rng.integers(0, 256, 6, dtype=np.uint8))
              for h in rng.integers(1, 400, 150, dtype=np.uint64)}
    fetched: list[list[int]] = [[], []]

    def fetcher(log):
        def fetch(key: bytes):
            log.append(int.from_bytes(key, "big"))
            return server.get(int.from_bytes(key, "big"))
        return fetch

    with native.Tally() as tally:
        c = native.C.BlockTable(fetcher(fetched[0]))
    assert tally.c("block_table") == 1
    with native.forced("python"), native.Tally() as tally:
        py = BlockView(fetcher(fetched[1]))
    assert tally.python("block_table") == 1
    absent_loaded: set[int] = set()
    for step in range(300):
        hashes = rng.integers(1, 400, int(rng.integers(0, 40)), dtype=np.uint64)
        kind = step % 5
        if kind == 0:
            got = c.wanted(hashes)
            assert got == py.wanted(hashes)
            assert c.wanted(hashes) == py.wanted(hashes) == b""  # each named once
            wanted = np.frombuffer(got, np.uint64)
            values = [server.get(int(h)) for h in wanted]
            absent_loaded.update(int(h) for h, v in zip(wanted, values, strict=True) if v is None)
            c.load(wanted, values)
            py.load(wanted, values)
        elif kind == 1:
            seg, first = int(rng.integers(1, 1 << 32)), int(rng.integers(0, 60000))
            c.put(hashes, seg, first)
            py.put(hashes, seg, first)
        elif kind == 2:
            c.delete(hashes)
            py.delete(hashes)
        else:
            assert c.get(hashes) == py.get(hashes)
    assert fetched[0] == fetched[1]

    def table(changes):
        keys, values, gone = changes
        return (dict(zip(np.frombuffer(keys, ">u8").tolist(),
                         [values[i:i + 6] for i in range(0, len(values), 6)], strict=True)),
                sorted(np.frombuffer(gone, ">u8").tolist()))

    assert table(c.changes()) == table(py.changes())
    sets, gone = table(c.changes())
    read_absent = {h for h in fetched[0] if h not in server} | absent_loaded
    assert sets and gone and not read_absent & set(gone)
    # what a writer keeps after the commit, and a next write taking from it
    known_c, known_py = native.C.BlockTable(fetcher([])), BlockView(fetcher([]))
    known_c.absorb(c)
    known_py.absorb(py)
    assert len(known_c) == len(known_py) > 0
    hashes = rng.integers(1, 800, 300, dtype=np.uint64)
    next_c, next_py = native.C.BlockTable(fetcher([])), BlockView(fetcher([]))
    wanted = next_c.wanted(hashes)
    assert wanted == next_py.wanted(hashes)
    assert next_c.take(known_c, np.frombuffer(wanted, np.uint64)) == \
        next_py.take(known_py, np.frombuffer(wanted, np.uint64))
    taken = np.array([h for h in np.frombuffer(wanted, np.uint64).tolist()
                      if h in known_py._had], np.uint64)
    assert next_c.get(taken) == next_py.get(taken) == c.get(taken)  # as the commit left
    assert next_c.changes() == (b"", b"", b"")  # taken entries are read, not changed
    with pytest.raises(ValueError, match="3 bytes is not whole uint64s"):
        c.get(b"abc")
    with pytest.raises(ValueError, match="blocks table entry of 2 bytes"):
        c.load(np.array([999], np.uint64), [b"xy"])
    with pytest.raises(ValueError, match="1 hashes and 0 values"):
        c.load(np.array([998], np.uint64), [])
