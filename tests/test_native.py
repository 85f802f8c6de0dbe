"""The match step in C (`verify.c`) against its Python reference, record by record;
each run asserts which path it took (`sarp.native.Tally`)."""

import contextlib
import multiprocessing as mp
import struct

import numpy as np
import orjson
import pytest

from sarp import answer, native, segment, verify
from sarp.errors import CorruptRecordError, ParentNotFoundError
from sarp.hashing import checksum
from sarp.segment import HASHES_AT, Segment
from sarp.serving import rfc

pytestmark = pytest.mark.skipif(
    not native.AVAILABLE, reason=f"sarp._native {native.WHY} (SARP_REQUIRE_NATIVE=1, as "
    "in CI, makes that a failure); the Python path is what every other test runs then")


def _random_record(rng) -> tuple[Segment, bytes]:
    n = int(rng.choice([1, 2, 7, 16, 33, 300, 1024]))
    nh = int(rng.integers(1, 11))
    presence = (rng.random((nh, n)) < rng.choice([0.5, 0.9, 1.0])).astype(np.uint8)
    if rng.random() < 0.5:  # as engines store them: each row a leading run
        for row, run in zip(presence, rng.integers(0, n + 1, nh), strict=True):
            row[:] = 0
            row[:run] = 1
    root = rng.random() < 0.3
    seg = Segment(
        int(rng.integers(1, 1 << 31)), 0 if root else int(rng.integers(1, 50)),
        None if root else int(rng.integers(0, 1 << 64, dtype=np.uint64)),
        rng.integers(0, 1 << 64, n, dtype=np.uint64),
        rng.choice(np.arange(1, 4000, dtype=np.uint16), nh, replace=False),
        presence,
        rng.integers(-1, 1000, (nh, n)).astype(np.int64) if rng.random() < 0.3 else None,
    )
    return seg, seg.encode()


def _damaged(rng, record: bytes) -> bytes:
    """The record cut short, grown, or with one bit flipped."""
    damaged = bytearray(record)
    cut = rng.random()
    if cut < 0.2:
        damaged = damaged[: int(rng.integers(0, len(damaged)))]
    elif cut < 0.3:
        damaged += b"\0" * 8
    else:
        damaged[int(rng.integers(0, len(damaged)))] ^= 1 << int(rng.integers(0, 8))
    return bytes(damaged)


def _query_for(rng, seg: Segment) -> tuple[bytes, int, int | None]:
    """A query that reaches the segment at its place (mostly), then agrees for a while."""
    start = seg.start_pos if rng.random() < 0.9 else seg.start_pos + 1
    parent = seg.parent if rng.random() < 0.9 else int(rng.integers(0, 1 << 64, dtype=np.uint64))
    if seg.parent is None and rng.random() < 0.1:
        parent = 5
    before = rng.integers(0, 1 << 64, start, dtype=np.uint64)
    agree = int(rng.integers(0, seg.hashes.size + 1))
    after = np.concatenate([seg.hashes[:agree],
                            rng.integers(0, 1 << 64, int(rng.integers(0, 40)), dtype=np.uint64)])
    query = np.concatenate([before, after]).astype("<u8")
    return query.tobytes(), start, parent


@pytest.mark.parametrize("seed", range(4))
def test_the_c_step_answers_what_the_python_step_answers(seed):
    rng = np.random.default_rng(seed)
    for _ in range(1500):
        seg, record = _random_record(rng)
        query, start, parent = _query_for(rng, seg)
        if len(query) // 8 <= start:
            continue
        expected = verify.examine_py(seg.seg_id, record, query, start, parent)
        with native.forced("c"), native.Tally() as t:
            assert verify.examine(seg.seg_id, record, query, start, parent) == expected
        assert (t.c("examine"), t.python("examine")) == (1, 0)


@pytest.mark.parametrize("seed", range(2))
def test_a_damaged_record_raises_what_the_python_step_raises(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(500):
        seg, record = _random_record(rng)
        query = seg.hashes.astype("<u8").tobytes()
        damaged = _damaged(rng, record)
        with native.forced("c"):
            code = native.C.examine(damaged, query, seg.start_pos, seg.parent or 0,
                                    seg.parent is not None)
        assert code < 0
        with pytest.raises(CorruptRecordError) as python_error:
            verify.examine_py(seg.seg_id, damaged, query, seg.start_pos, seg.parent)
        # C and Python find the same damage: C's code means what Python's message says
        assert segment.DAMAGE[code] in str(python_error.value), (code, python_error.value)


@pytest.mark.parametrize("seed", range(2))
def test_the_c_heads_read_what_the_python_heads_read(seed):
    """A reader's replay checks its records in one call: checked ones, segments gone
    (None) and damaged ones (cut, grown, a bit flipped, a holder named twice) give the
    same first hashes, states, counts and holder ids in C as in Python."""
    rng = np.random.default_rng(200 + seed)
    records: list[bytes | None] = []
    for _ in range(400):
        kind = rng.random()
        seg, record = _random_record(rng)
        if kind < 0.1:
            records.append(None)
        elif kind < 0.35:
            records.append(_damaged(rng, record))
        elif kind < 0.4 and len(seg.holder_ids) > 1:
            twice = bytearray(record[:-8])  # the second holder id made the first's
            at = HASHES_AT + 8 * len(seg.hashes)
            twice[at + 2 : at + 4] = twice[at : at + 2]
            records.append(bytes(twice) + struct.pack("<Q", checksum(bytes(twice))))
        else:
            records.append(record)
    with native.forced("python"):
        expected = [a.tolist() for a in segment.heads(records)]
    with native.forced("c"), native.Tally() as t:
        got = [a.tolist() for a in segment.heads(records)]
    assert got == expected
    assert (t.c("heads"), t.python("heads")) == (1, 0)
    states = expected[1]
    assert {0, 1, -5} <= set(states) and min(states) < 0  # every kind was met
    for record, state, first in zip(records, states, expected[0], strict=True):
        if state < 0:  # C's code means what the Python check's message says
            with pytest.raises(CorruptRecordError, match=segment.DAMAGE[state]):
                segment.head(1, record)
        elif state == 1:
            assert first == segment.head(1, record)[0]


@pytest.mark.parametrize("segment_blocks", [1, 4, 64])
@pytest.mark.parametrize("media", [False, True])
def test_the_c_walk_answers_what_the_python_walk_answers(tmp_path, segment_blocks, media):
    """Per holder; with instances over two media (then per instance too); with and
    without per-block presence: every field of the answer, C against Python."""
    import sarp

    rng = np.random.default_rng(segment_blocks + 100 * media)
    # engines e0-e3 of one model, e1 and e4 both rank 1 of instance "7" (the answer keeps
    # the last), an id JSON must escape; e5 is another model's
    model = rfc.Model("m", "default", 16, 0, {"e0": ('9"\\\n\x01é', 0), "e1": ("7", 1),
                                              "e2": ("7", 0), "e3": ("8", 3), "e4": ("7", 1)})
    chains = [rng.integers(0, 1 << 64, 40, dtype=np.uint64) for _ in range(6)]
    for c in chains[1:4]:  # branches off the first chain
        c[:10] = chains[0][:10]
    with sarp.open(tmp_path / "ix", durability="nosync", segment_blocks=segment_blocks) as ix:
        for _ in range(120):
            chain = chains[rng.integers(len(chains))]
            holder = f"e{rng.integers(6)}"
            medium = ("GPU", "CPU", "DISK")[rng.integers(3)] if media else "GPU"
            lo, hi = sorted(rng.integers(0, 41, 2).tolist())
            middle = media and 0 < lo < hi and rng.random() < 0.3  # a tier's later blocks
            if rng.random() < 0.7 and hi:
                with contextlib.suppress(ParentNotFoundError):  # a parent no one holds
                    ix.insert(chain[lo:hi] if middle else chain[:hi], holder=holder,
                              medium=medium, parent=int(chain[lo - 1]) if middle else None)
            elif hi > lo:
                ix.remove(chain[lo:hi], holder=holder, medium=medium)
            queries = [chain[: rng.integers(1, 41)] for chain in chains]
            queries.append(np.concatenate([chains[0][:12], chains[1][12:20]]))
            for query in queries:
                for presence in (False, True):
                    with native.forced("c"), native.Tally() as in_c:
                        got = ix.match(query, with_presence=presence)
                    with native.forced("python"), native.Tally() as in_python:
                        expected = ix.match(query, with_presence=presence)
                    assert (in_c.c("walk"), in_c.python("walk")) == (1, 0)
                    assert (in_python.c("walk"), in_python.c("examine"),
                            in_python.python("walk")) == (0, 0, 1)
                    assert (got.num_blocks, got.by_holder, got.by_medium, got.storage_reads,
                            got.multi_medium) == (
                        expected.num_blocks, expected.by_holder, expected.by_medium,
                        expected.storage_reads, expected.multi_medium)
                    assert {k: v.tolist() for k, v in got.presence.items()} == {
                        k: v.tolist() for k, v in expected.presence.items()}
                    rows_path = presence or ix.multi_medium
                    assert (in_c.c("rows_result"), in_c.python("rows_result")) == (
                        int(rows_path), 0)
                    if presence:  # RFC #1403's answer from the rows, in C
                        with native.Tally() as answered:
                            body = rfc.answer_c(got, model)
                        assert answered.c("rfc_answer") == 1 and body is not None
                        assert orjson.loads(body) == rfc.answer(expected, model)
                        assert body == orjson.dumps(rfc.answer(got, model))
                        # the rows alone (serve's /query): the same answer and rows, no
                        # array per holder, and the Python answer makes them
                        rows = ix.match(query, with_presence="rows")
                        assert (rows.num_blocks, rows.by_holder, rows.by_medium,
                                rows.holder_rows, rows.presence) == (
                            got.num_blocks, got.by_holder, got.by_medium, got.holder_rows,
                            {})
                        assert rfc.answer_c(rows, model) == body
                        assert rfc.answer(rows, model) == rfc.answer(got, model)


@pytest.mark.parametrize("media", [False, True])
def test_a_segment_with_more_holders_than_c_takes_is_walked_in_python(tmp_path, media):
    """C hands back a walk whose segment has more holders than MAX_WALK_HOLDERS (64):
    the match walks it in Python once, not in C again, and answers the same."""
    import sarp

    chain = np.arange(1, 9, dtype=np.uint64)
    with sarp.open(tmp_path / "ix", durability="nosync") as ix:
        for k in range(70):
            ix.insert(chain[: 4 + k % 4], holder=f"e{k}",
                      medium="CPU" if media and k % 2 else "GPU")
        for presence in (False, True):
            with native.Tally() as t:
                got = ix.match(chain, with_presence=presence)
            assert (t.c("walk"), t.python("walk")) == (1, 1)
            with native.forced("python"):
                expected = ix.match(chain, with_presence=presence)
            assert (got.num_blocks, got.by_holder, got.by_medium) == (
                expected.num_blocks, expected.by_holder, expected.by_medium)
            assert got.num_blocks == 7 and len(got.by_holder) == 70


@pytest.mark.parametrize("seed", range(40))
def test_the_c_runs_and_rfc_answer_are_their_references(seed):
    """Rows as a walk leaves them, with what a match meets at the edges: a holder with no
    name (not verified), one newer than the instance table, one of no instance (-1),
    several of one instance in one medium, two media ORed into an instance's run."""
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 12))
    nholders = int(rng.integers(0, 14))
    rows = {int(h): (rng.random(total) < 0.7).astype(np.uint8).tobytes()
            for h in rng.permutation(20)[:nholders]}
    media = ("GPU", "CPU", "DISK", "EXTERNAL")
    names = {h: (f"i{rng.integers(5)}", media[rng.integers(4)]) for h in rows
             if rng.random() < 0.9}
    instance_names = [f"i{k}" for k in range(5)]
    instance_of = [int(rng.integers(-1, 5)) for _ in range(int(rng.integers(0, 21)))]
    for grouping in (None, instance_of):
        args = (rows, names, grouping, instance_names, total)
        with native.Tally() as t:
            got = native.C.rows_result(*args)
        assert t.c("rows_result") == 1
        assert got == answer.runs_of_rows(*args)
        assert list(got[0]) == list(answer.runs_of_rows(*args)[0])  # in the same order
    runs = {h: int(rng.integers(0, total + 1)) for h in rows}  # a walk of one medium each
    with native.Tally() as t:
        assert native.C.plain_result(runs, names) == answer.plain_runs(runs, names)
    assert t.c("plain_result") == 1
    by_holder, by_medium = answer.runs_of_rows(rows, names, instance_of, instance_names, total)
    presence = {names[h]: np.frombuffer(row, bool) for h, row in rows.items() if h in names}
    match = answer.Match(total, by_holder, by_medium, {}, 1, presence, True,
                         answer.HolderRows(rows, names))
    ranks = {f"i{k}": (str(rng.integers(3)), int(rng.integers(2))) for k in range(5)
             if rng.random() < 0.8}
    model = rfc.Model("m", "default", int(rng.integers(1, 64)), 0, ranks)
    assert native.C.rfc_answer(rows, names, ranks, model.block_size) == orjson.dumps(
        rfc.answer(match, model))
    many = {h: b"\x01" for h in range(300)}  # past what C scans: the Python answer
    assert native.C.rfc_answer(many, {}, ranks, 16) is None


def test_the_python_path_alone_passes_the_model_test():
    """Where the extension is not built, the Python path runs everything: the
    model-based test (match, match_many, inserts, removes, clears) holds on it too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import sarp.native as n; assert n.C is None; "
            "import pytest, sys; rc = pytest.main(['-q', '-x', '-p', 'no:cacheprovider', "
            "'tests/test_model.py']); calls = n.calls(); "
            "assert all(c == 0 for c, _ in calls.values()), calls; "
            "assert calls['walk'][1] and calls['pack_batch'][1], calls; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "SARP_PURE_PYTHON": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("seed", range(4))
def test_the_c_directory_lookup_answers_what_numpy_answers(seed):
    """``Directory.lookup_many`` in C (``directory.c``) against its numpy passes and
    against one ``lookup`` per hash, on directories with changes since their arrays
    were merged (added, removed, removed and added again) and on merged ones; the
    query as it comes (a strided view, hashes twice, ones that were never there)."""
    from sarp.directory import Directory

    rng = np.random.default_rng(seed)
    small = seed % 2 == 0  # hashes from a small range: many collide with the changes
    for _ in range(60):
        draw = (lambda n: rng.integers(1, 80, n, dtype=np.uint64)) if small else (
            lambda n: rng.integers(1, 1 << 64, n, dtype=np.uint64))
        keys = np.unique(draw(int(rng.integers(0, 300))))
        d = Directory.from_entries(keys, rng.integers(0, 1 << 32, keys.size, dtype=np.uint64))
        for _ in range(int(rng.integers(0, 40))):
            key = int(draw(1)[0])
            if rng.random() < 0.5:
                d.add(key, int(rng.integers(0, 1 << 32)))
            elif (seg := d.lookup(key)) is not None:
                d.remove(key, seg)
        if rng.random() < 0.2:
            d.compact()
        query = np.concatenate([keys[: int(rng.integers(0, 10))], draw(int(rng.integers(40, 90)))])
        query = np.repeat(query, 2)[::-2]  # a strided view, each hash once, reversed
        with native.forced("c"), native.Tally() as t:
            got_c = d.lookup_many(query)
        with native.forced("python"), native.Tally() as p:
            got_py = d.lookup_many(query)
        assert t.c("find") == 1 and p.python("find") == 1
        want = [-1 if (s := d.lookup(int(k))) is None else s for k in query.tolist()]
        assert got_c.tolist() == got_py.tolist() == want
        # a reader's prediction: each segment named once, in query order, as keys
        for q in (query, query[: int(rng.integers(0, 20))]):
            found = [-1 if (s := d.lookup(int(k))) is None else s for k in q.tolist()]
            keys_want = [s.to_bytes(8, "big") for s in dict.fromkeys(found) if s >= 0]
            with native.forced("c"), native.Tally() as t:
                keys_c = d.predicted_keys(q)
            with native.forced("python"):
                keys_py = d.predicted_keys(q)
            assert keys_c == keys_py == keys_want


def test_the_c_directory_lookup_refuses_arrays_of_another_shape():
    with pytest.raises(ValueError, match="one length"):
        native.C.find(np.empty(2, np.int64), np.zeros(3, np.uint64), np.zeros(1, np.uint64),
                      np.zeros(1, np.uint32))
    with pytest.raises(ValueError, match="8-byte items"):
        native.C.find(np.empty(2, np.int64), np.zeros(3, np.uint8), np.zeros(1, np.uint64),
                      np.zeros(1, np.uint32))
    with pytest.raises(TypeError):
        native.C.find(np.empty(2, np.int64))
    with pytest.raises(ValueError, match="one length"):
        native.C.predict(np.zeros(3, np.uint64), np.zeros(2, np.uint64), np.zeros(1, np.uint32))
    with pytest.raises(TypeError):
        native.C.predict(np.zeros(3, np.uint64))


def _rfc_general(ix, body: bytes, models: dict) -> bytes:
    """The general path of serve's /query (the reference of rfc_query)."""
    from sarp.serving import http

    model, keys = rfc.query_keys(rfc.query_fields(body), models)
    return http.rfc_json(ix.match(keys, with_presence="rows"), model)


@pytest.mark.parametrize("raw", [True, False], ids=["liblmdb", "py-lmdb"])
@pytest.mark.parametrize("media", [False, True])
def test_a_whole_query_in_c_is_the_general_path_s_and_never_ahead_of_the_store(tmp_path,
                                                                             media, raw):
    """rfc_query on a reader beside a writer: after each of the writer's commits C
    leaves the query to the general path (the reader's memory is behind the store),
    which catches up; then C answers, byte for byte as the general path does; and C
    leaves to it what it does not answer.  C reads in read transactions of liblmdb's
    own (``raw``), or in py-lmdb's."""
    import sarp
    from sarp.tokenkeys import model_root

    rng = np.random.default_rng(7 + media)
    root = model_root("m")
    models = {("m", "default"): rfc.Model("m", "default", 4, root, {
        "e0": ("7", 0), "e1": ("7", 1), "e2": ("8", 0), "e3": ('9"\\', 2)})}
    chains = [rng.integers(0, 151_936, 4 * 12, dtype=np.uint32) for _ in range(4)]
    for c in chains[1:]:
        c[:12] = chains[0][:12]  # three blocks in common
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    writer = context.Process(target=_writer_main, args=(str(tmp_path / "ix"), theirs),
                             daemon=True)
    writer.start()
    assert ours.poll(60) and ours.recv() == "ready"
    with contextlib.ExitStack() as stack:
        stack.callback(writer.join, 30)
        stack.callback(ours.send, None)  # (first: the writer stops, however this ends)
        _answer_beside_a_writer(stack.enter_context(sarp.open(tmp_path / "ix", readonly=True)),
                                ours, rng, chains, root, models, media, raw)
    with sarp.open(tmp_path / "ix") as index:  # the writer's own (serve's HTTP thread)
        _answer_on_the_writer(index, rng, chains, root, models, raw)


def _refused_while_held(lock, body: bytes, models, reading) -> None:
    """rfc_query leaves ``body`` to the general path while another thread holds ``lock``."""
    import threading

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        assert rfc.answer_now(body, models, reading) is None
    finally:
        release.set()
        holder.join(10)


def _answer_on_the_writer(index, rng, chains, root, models, raw: bool) -> None:
    """rfc_query on the writer's own index: after each commit C answers as the general
    path does (the writer's memory is current once its commit is in it); while the
    writer's memory lock is held (a commit going into memory) or its memory is behind
    the store, C leaves the query to the general path."""

    from sarp.tokenkeys import token_keys

    reading = rfc.reading_of(index.reading())
    assert reading is not None
    if not raw:
        reading = (*reading[:-1], None)
    for step in range(30):
        chain = chains[rng.integers(len(chains))]
        keys = token_keys(chain, 4, parent=root)[0]
        hi = int(rng.integers(1, 13))
        if rng.random() < 0.7:
            index.insert(keys[:hi], holder=f"e{rng.integers(5)}")
        else:
            index.remove(keys[hi - 1:], holder=f"e{rng.integers(5)}")
        body = orjson.dumps({"token_ids": chain[: int(rng.integers(4, 49))].tolist(),
                             "model_name": "m"})
        with native.Tally() as t:
            got = rfc.answer_now(body, models, reading)
        assert t.c("rfc_query") == 1 and got == _rfc_general(index, body, models), step
    _refused_while_held(reading[0], body, models, reading)  # as in the writer's _apply
    assert rfc.answer_now(body, models, reading) == got
    memory = index.reading().memory
    memory.watermark -= 1  # memory behind the store: the general path's
    assert rfc.answer_now(body, models, reading) is None
    memory.watermark += 1
    assert rfc.answer_now(body, models, reading) == got


def _answer_beside_a_writer(reader, ours, rng, chains, root, models, media, raw) -> None:
    """The test above, its writer at the other end of ``ours``."""

    import lmdb

    from sarp.tokenkeys import token_keys

    reading = rfc.reading_of(reader.reading())
    assert reading is not None
    if lmdb.__version__.startswith("3.0."):  # the layout lmdb_env reads: C's reads
        assert reading[-1] is not None
    if not raw:
        reading = (*reading[:-1], None)
    raw = reading[-1] is not None
    for step in range(60):
        chain = chains[rng.integers(len(chains))]
        keys = token_keys(chain, 4, parent=root)[0]
        holder, medium = f"e{rng.integers(5)}", ("GPU", "CPU")[rng.integers(2)] \
            if media else "GPU"
        hi = int(rng.integers(1, 13))
        if rng.random() < 0.7:
            ours.send(("insert", keys[:hi].tolist(), holder, medium))
        else:
            ours.send(("remove", keys[hi - 1:].tolist(), holder, medium))
        assert ours.poll(30) and ours.recv() == "done"
        body = orjson.dumps({"token_ids": chain[: int(rng.integers(4, 49))].tolist(),
                             "model_name": "m"})
        state = reader.reading()
        behind = state.store.counter("next_seq") != state.memory.watermark
        with native.Tally() as t:
            got = rfc.answer_now(body, models, reading)
        assert (got is None, t.python("rfc_query")) == (behind, int(behind)), step
        expected = _rfc_general(reader, body, models)  # caught up
        with native.Tally() as t:
            got = rfc.answer_now(body, models, reading)
        assert (t.c("rfc_query"), t.python("rfc_query"), t.c("walk")) == (1, 0, 1)
        assert t.c("lmdb_read") == int(raw)
        assert got == expected, step
    body = orjson.dumps({"token_ids": chains[0].tolist(), "model_name": "m"})
    assert rfc.answer_now(body, models, reading) == _rfc_general(reader, body, models)
    # what C leaves to the general path
    other = {"token_ids": chains[0].tolist(), "model_name": "m"}
    for asked in ({**other, "lora_name": "a"}, {**other, "model_name": "q"},
                  {**other, "routing_group": "b"}, {**other, "token_ids": [1, 2, 3]},
                  {"model_name": "m", **other}):
        assert rfc.answer_now(orjson.dumps(asked), models, reading) is None, asked
    _refused_while_held(reader._lock, body, models, reading)  # the parse thread, matching
    assert rfc.answer_now(body, models, reading) is not None
    reader.observe_matches(lambda query: None)
    assert rfc.answer_now(body, models, reading) is None


def _writer_main(path: str, conn) -> None:
    """The writer beside the reader of the test above, in a process of its own (LMDB
    opens an environment once per process)."""
    import sarp

    with sarp.open(path, durability="nosync", segment_blocks=4) as index:
        conn.send("ready")
        while (msg := conn.recv()) is not None:
            op, keys, holder, medium = msg
            with contextlib.suppress(ParentNotFoundError):
                getattr(index, op)(keys, holder=holder, medium=medium)
            conn.send("done")
