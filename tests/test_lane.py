"""The in-line lane (`sarp.serving.lane`): the C ``take_line`` against its Python
reference on the same messages, call for call and column for column, and the
subscriber with and without the lane, index for index.

The reference comparison runs over inproc pairs: a message sent there is in the
receiver's pipe when ``send`` returns, so both sides see the same messages at every
call (over TCP, one side could run dry a message earlier than the other)."""

from __future__ import annotations

import logging
import random
import time

import msgpack
import pytest
import zmq
from test_subscriber import chains, engine, held, wait_applied

import sarp
from sarp import native
from sarp.errors import StoreError
from sarp.serving import lane, subscriber
from sarp.serving.columns import FIELDS, Columns
from sarp.serving.events import encode_batch
from sarp.serving.subscriber import Source, Subscriber
from sarp.tokenkeys import model_root

pytestmark = pytest.mark.skipif(
    not native.AVAILABLE, reason=f"sarp._native {native.WHY} (SARP_REQUIRE_NATIVE=1, as "
    "in CI, makes that a failure); without it every message goes one by one")


def _batch(rng: random.Random, ts: float, rank: int | None, tokens: bool) -> bytes:
    events = []
    for _ in range(rng.randint(1, 4)):
        hashes = [rng.getrandbits(63) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.7:
            events.append(("stored", hashes, None, rng.choice(["GPU", "cpu"])))
        else:
            events.append(("removed", hashes, "GPU"))
    if rng.random() < 0.05:
        events.append(("stored", [1, 1], None, "GPU"))  # a repeated hash: Python's
    return encode_batch(events, ts=ts, dp_rank=rank,
                        style="vllm-0.33" if tokens else rng.choice(["vllm-0.11", "sglang"]))


def _stream(seed: int, count: int, tokens: bool) -> list[list[bytes]]:
    """Messages mostly in line, with every way of leaving it now and then."""
    rng = random.Random(seed)
    seq, ts, out = 0, 100.0, []
    for _ in range(count):
        roll = rng.random()
        ts += rng.random()
        rank = 0
        if roll < 0.04:
            seq += rng.randint(2, 5)  # a gap
        elif roll < 0.08:
            ts -= rng.choice([0.5, 5.0])  # back within the slack, or beyond it
        elif roll < 0.12:
            rank = rng.choice([None, 1])
        payload = _batch(rng, ts, rank, tokens)
        if roll > 0.97:
            payload = msgpack.packb([ts, [["AllBlocksCleared"]]])
        elif roll > 0.94:
            payload = b"\x93\xff not msgpack"
        seq_bytes = seq.to_bytes(8, "big", signed=True)
        shape = rng.random()
        if shape < 0.03:
            frames = [seq_bytes, payload]
        elif shape < 0.06:
            frames = [b"", b"kv", seq_bytes, payload]
        elif shape < 0.09:
            frames = [b"", seq_bytes, payload]
        elif shape < 0.11:
            frames = [b"kv", seq_bytes, payload, b"extra", b"more"]
        elif shape < 0.13:
            frames = [b"kv", (-1).to_bytes(8, "big", signed=True), payload]
        elif shape < 0.15:
            frames = [b"kv", seq_bytes[:7], payload]
        else:
            frames = [b"kv", seq_bytes, payload]
        out.append(frames)
        seq += 1
    return out


def _drive(take, sock: zmq.Socket, seed: int, tokens: bool) -> tuple[list, dict]:
    """Call ``take`` until the socket runs dry, moving on as a subscriber would: past
    what it took, and past a message handed back (to its sequence, if it has one)."""
    rng = random.Random(seed)
    columns, answers = Columns(), []
    expected, floor = 0, float("-inf")
    root = model_root("llama") if tokens else None
    while True:
        rank_fixed = rng.random() < 0.3
        got = take(sock, rng.randint(1, 8), expected, floor, 1.0, tokens, root, "e#0",
                   0, rank_fixed, columns)
        answers.append((got, columns.mark()))
        status, digests, stamps, _, _, frames = got
        expected += len(digests)
        if stamps:
            floor = stamps[-1] - 1.0
        if status == lane.DRY:
            break
        if frames is not None and len(frames) >= 2 and len(frames[-2]) == 8:
            expected = max(expected, int.from_bytes(frames[-2], "big", signed=True) + 1)
    taken = columns.take()
    return answers, {f: getattr(taken, f).tolist() for f in FIELDS} | {"names": taken.names}


@pytest.mark.parametrize("tokens", [False, True], ids=["engine-hashes", "token-keyed"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_lane_takes_what_its_reference_takes(seed, tokens):
    assert lane.Lane.open() is not None, "the lane failed its check on this machine"
    messages = _stream(seed, 400, tokens)
    context = zmq.Context()
    results = []
    before = native.calls()["take_line"]
    try:
        for n, take in enumerate((lane.Lane().take, lane.take_line_python)):
            a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
            a.bind(f"inproc://lane-{n}")
            b.connect(f"inproc://lane-{n}")
            for frames in messages:
                a.send_multipart(frames)
            results.append(_drive(take, b, seed, tokens))
            a.close(linger=0)
            b.close(linger=0)
    finally:
        context.term()
    (c_answers, c_columns), (py_answers, py_columns) = results
    assert native.calls()["take_line"][0] - before[0] == len(c_answers)
    for i, (c, py) in enumerate(zip(c_answers, py_answers, strict=True)):
        assert c == py, f"call {i}"
    assert c_columns == py_columns
    statuses = {got[0] for got, _ in c_answers}
    assert statuses == {lane.TAKEN_ALL, lane.DRY, lane.NOT_IN_LINE}  # the stream meets each
    assert sum(len(got[1]) for got, _ in c_answers) > 200  # most went in line


def test_a_lane_that_fails_its_check_is_not_used(monkeypatch, caplog):
    monkeypatch.setattr(lane.Lane, "_checked", None)
    monkeypatch.setattr(lane, "_check", lambda _lane: False)
    with caplog.at_level(logging.WARNING, logger="sarp.lane"):
        assert lane.Lane.open() is None
    assert "failed its check" in caplog.text
    monkeypatch.setattr(lane.Lane, "_checked", None)

    def broken(_lane):
        raise OverflowError("a binding that is not libzmq's")

    monkeypatch.setattr(lane, "_check", broken)  # an error is a failed check, not a stop
    assert lane.Lane.open() is None
    monkeypatch.setattr(lane.Lane, "_checked", None)
    monkeypatch.setattr(lane, "libzmq_calls", lambda: None)
    assert lane.Lane.open() is None
    monkeypatch.setattr(lane.Lane, "_checked", None)  # an address of 0: refused, not used
    monkeypatch.setattr(lane, "libzmq_calls", lambda: (0,) * 7)
    assert lane.Lane.open() is None


def _follow(tmp_path, name: str, with_lane: bool, monkeypatch,
            prefetching: bool = True) -> tuple[dict, set, int]:
    """One engine's flood, with gaps and a restart, followed to its end."""
    if not with_lane:
        monkeypatch.setattr(lane.Lane, "open", classmethod(lambda cls: None))
    monkeypatch.setattr(subscriber, "MAX_BATCH_OPS", 64)  # commits within the backlog
    eng = engine(capacity=200)
    before = native.calls()["take_line"][0]
    try:
        with sarp.open(tmp_path / name, durability="nosync") as index:
            pub = eng.publisher
            sub = Subscriber(index, [Source(eng.name, pub.endpoint, pub.replay_endpoint)])
            sub.prefetching = prefetching
            assert (sub._lane is not None) == with_lane
            time.sleep(0.2)
            for i, chain in enumerate(chains(7, 600)):
                eng.serve(chain, drop=300 <= i < 303)  # a gap: proven from the buffer
            time.sleep(0.3)  # queued: a backlog, whose commits a prefetch overlaps
            wait_applied(sub, "e", pub)
            assert (sub.prefetched > 0) == (with_lane and prefetching)
            got = held(index, eng.holder)
            assert got == set(eng.cache)
            stats = sub.summary()["e"]
            sub.close()
    finally:
        eng.publisher.close()
        monkeypatch.undo()
    return stats, got, native.calls()["take_line"][0] - before


def test_the_subscriber_with_the_lane_keeps_what_it_keeps_without(tmp_path, monkeypatch):
    with_lane, held_with, lane_calls = _follow(tmp_path, "a", True, monkeypatch)
    no_prefetch, held_no_prefetch, _ = _follow(tmp_path, "c", True, monkeypatch,
                                               prefetching=False)
    without, held_without, no_calls = _follow(tmp_path, "b", False, monkeypatch)
    assert lane_calls > 0 and no_calls == 0
    assert held_with == held_no_prefetch == held_without != set()
    same = ("batches", "gaps", "restarts", "bad_frames", "last_seq")
    for stats in (with_lane, no_prefetch):
        assert {k: stats[k] for k in same} == {k: without[k] for k in same}
    for stats in (with_lane, no_prefetch, without):
        del stats["applied"]["seconds"]  # (a timing)
    assert with_lane["applied"] == no_prefetch["applied"] == without["applied"]
    assert with_lane["gaps"] >= 1


def _flood_and_follow(sub: Subscriber, index, engines: list, seed: int, n: int) -> None:
    """``n`` requests over the engines, queued before the subscriber reads, then polled
    until it has every batch and the index holds each engine's cache (60 s at most)."""
    time.sleep(0.3)
    for i, chain in enumerate(chains(seed, n)):
        engines[i % len(engines)].serve(chain)
    time.sleep(0.5)  # queued
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            sub.last_seq.get(e.name, -1) >= e.publisher.next_seq - 1
            and held(index, e.holder) == set(e.cache) for e in engines):
        sub.poll(20)


def test_a_write_that_fails_while_the_prefetch_takes_drops_what_it_took_and_proves_again(
        tmp_path, monkeypatch):
    """A commit fails (the store's error) with a prefetch taking the next messages:
    they are dropped with what was not committed, every source is proven again from
    its buffer, and the index ends as the engines hold their blocks."""
    monkeypatch.setattr(subscriber, "MAX_BATCH_OPS", 64)  # commits within the backlog
    engines = [engine(f"e{k}", capacity=300) for k in range(3)]
    failed = []
    try:
        with sarp.open(tmp_path / "ix", durability="nosync") as index:
            sub = Subscriber(index, [Source(e.name, e.publisher.endpoint,
                                            e.publisher.replay_endpoint) for e in engines])
            real_start, real_flush = lane.Prefetch.start, sub.applier.flush
            running = []

            def start(*args):
                got = real_start(*args)
                running.append(got)
                return got

            def flush(state):
                if running and not failed:  # the first commit under a prefetch fails
                    failed.append(len(sub.applier.columns))
                    raise StoreError("the disk is full (injected)")
                return real_flush(state)

            sub.applier.flush = flush
            monkeypatch.setattr(lane.Prefetch, "start", staticmethod(start))
            _flood_and_follow(sub, index, engines, 11, 900)
            assert failed and failed[0] > 0 and sub.store_errors == 1
            for e in engines:
                assert held(index, e.holder) == set(e.cache), e.name
            assert index.check() == []
            sub.close()
    finally:
        for e in engines:
            e.publisher.close()


def _prefetch_all(run, socks: list[zmq.Socket], seed: int, tokens: bool,
                  learnt: Columns) -> tuple[list, dict]:
    """Prefetch over ``socks`` again and again until each runs dry, moving each line
    on as the subscriber would (past a message handed back), on columns that know
    what ``learnt`` knows."""
    rng = random.Random(seed)
    columns, answers = learnt.copy(), []
    lines = [[sock, 0, float("-inf"), 1.0, tokens, model_root("llama") if tokens else None,
              f"e{k}#0", 0, rng.random() < 0.3] for k, sock in enumerate(socks)]
    live = list(range(len(socks)))
    while live:
        got = run([tuple(lines[j]) for j in live], rng.randint(1, 8),
                  rng.choice([5, 40, 10_000]), columns)
        answers.append(got)
        gave = set()
        for j, expected, first, (_, digests, stamps, _, _, frames) in got:
            line = lines[live[j]]
            assert expected == line[1] and first <= len(columns)
            line[1] += len(digests)
            line[2] = stamps[-1] - 1.0 if stamps else line[2]
            if frames is not None and len(frames) >= 2 and len(frames[-2]) == 8:
                line[1] = max(line[1], int.from_bytes(frames[-2], "big", signed=True) + 1)
            if digests or frames is not None:
                gave.add(live[j])
        live = [j for j in live if j in gave]  # one that gave nothing ran dry
    taken = columns.take()
    return answers, {f: getattr(taken, f).tolist() for f in FIELDS} | {"names": taken.names}


@pytest.mark.parametrize("tokens", [False, True], ids=["engine-hashes", "token-keyed"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_prefetch_takes_what_its_reference_takes(seed, tokens):
    """Four sources at once; the columns know some names (not the medium "cpu" of
    e1, nor any LoRA seed for half the seeds): what they do not know goes out of line."""
    assert lane.Lane.open() is not None
    learnt = Columns()
    for k in range(4):
        for medium in ("GPU", "cpu") if k != 1 else ("GPU",):
            learnt.add(msgpack.packb([1.0, [["BlockStored", [k + 1], None, [], 16, None,
                                            medium]]]), f"e{k}#0", None, tokens=False)
    if seed != 2:
        learnt._learn_seed(None)
    learnt.take()

    def c_run(lines, count, most, columns):
        return lane.Prefetch.start(lines, count, most, columns).end(columns, wait=True)

    context = zmq.Context()
    results = []
    try:
        for n, run in enumerate((c_run, lane.prefetch_python)):
            pairs = []
            for k in range(4):
                a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
                a.bind(f"inproc://prefetch-{n}-{k}")
                b.connect(f"inproc://prefetch-{n}-{k}")
                for frames in _stream(seed * 10 + k, 150, tokens):
                    a.send_multipart(frames)
                pairs.append((a, b))
            results.append(_prefetch_all(run, [b for _, b in pairs], seed, tokens, learnt))
            for a, b in pairs:
                a.close(linger=0)
                b.close(linger=0)
    finally:
        context.term()
    (c_answers, c_columns), (py_answers, py_columns) = results
    for i, (c, py) in enumerate(zip(c_answers, py_answers, strict=True)):
        assert c == py, f"prefetch {i}"
    assert len(c_answers) == len(py_answers)
    assert c_columns == py_columns
    takes = [t for got in c_answers for t in got]
    in_line = sum(len(t[3][1]) for t in takes)
    if tokens and seed == 2:  # no seed learnt: a store with its tokens is Python's
        assert 0 < in_line < 100
    else:
        assert in_line > 200  # most went in line
    assert {t[3][0] for t in takes} >= {lane.TAKEN_ALL, lane.NOT_IN_LINE}
    assert any(t[3][5] is not None and b"cpu" in t[3][5][-1] for t in takes)  # not learnt


def test_a_prefetch_dropped_or_stopped_leaves_the_columns_as_they_were():
    context = zmq.Context()
    try:
        a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        a.bind("inproc://prefetch-drop")
        b.connect("inproc://prefetch-drop")
        for frames in _stream(5, 50, False):
            a.send_multipart(frames)
        columns = Columns()
        line = (b, 0, float("-inf"), 1.0, False, None, "e0#0", 0, True)
        lane.Prefetch.start([line], 8, 10_000, columns).drop()
        assert len(columns) == 0
        ended = lane.Prefetch.start([line], 8, 10_000, columns)
        ended.end(columns)
        with pytest.raises(ValueError, match="has ended"):
            ended.end(columns)
        a.close(linger=0)
        b.close(linger=0)
    finally:
        context.term()


def test_a_prefetch_of_long_chains_beside_python_work_takes_what_its_reference_takes():
    """Stores of 150 to 300 blocks (the decoder's repeat check leaves its stack for
    the heap) decoded by the prefetch's thread while this one allocates Python
    objects: a Python allocation on that thread (it holds no GIL) would corrupt the
    heap they share; the columns end as the reference's."""
    rng = random.Random(9)
    streams = []
    for _ in range(4):
        frames = []
        for seq in range(60):
            hashes = [rng.getrandbits(63) for _ in range(rng.randint(150, 300))]
            payload = encode_batch([("stored", hashes, None, "GPU")], ts=100.0 + seq,
                                   dp_rank=0, style="vllm-0.11")
            frames.append([b"kv", seq.to_bytes(8, "big"), payload])
        streams.append(frames)
    learnt = Columns()
    for k in range(4):
        learnt.add(msgpack.packb([1.0, [["BlockStored", [1], None, [], 16, None, "GPU"]]]),
                   f"e{k}#0", None, tokens=False)
    learnt.take()
    context = zmq.Context()
    results = []
    try:
        for n, c_thread in enumerate((True, False)):
            pairs, columns = [], learnt.copy()
            for k in range(4):
                a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
                a.bind(f"inproc://long-{n}-{k}")
                b.connect(f"inproc://long-{n}-{k}")
                for frames in streams[k]:
                    a.send_multipart(frames)
                pairs.append((a, b))
            lines = [(b, 0, float("-inf"), 1.0, False, None, f"e{k}#0", 0, True)
                     for k, (_, b) in enumerate(pairs)]
            if c_thread:
                prefetch = lane.Prefetch.start(lines, 8, 1 << 20, columns)
                churn = [[{"k": i, "v": [i] * 8} for i in range(2000)] for _ in range(50)]
                del churn
                got = prefetch.end(columns, wait=True)
            else:
                got = lane.prefetch_python(lines, 8, 1 << 20, columns)
            taken = columns.take()
            results.append((got, {f: getattr(taken, f).tolist() for f in FIELDS}))
            for a, b in pairs:
                a.close(linger=0)
                b.close(linger=0)
    finally:
        context.term()
    assert results[0] == results[1]
    assert sum(len(t[3][1]) for t in results[0][0]) == 240  # every message, in line


@pytest.mark.parametrize("where", ["start", "end"])
def test_a_prefetch_that_fails_stops_nothing_and_its_messages_are_proven_again(
        tmp_path, monkeypatch, where):
    """A prefetch with no thread to start (the commit goes alone), or one whose end
    runs out of memory after it took messages (they are lost: a gap the engines'
    buffers fill): counted, and the index ends as the engines hold their blocks."""
    monkeypatch.setattr(subscriber, "MAX_BATCH_OPS", 64)  # commits within the backlog
    real_end = lane.Prefetch.end

    def start(*args):
        raise OSError("no thread (injected)")

    def end(self, columns, wait=False):
        real_end(self, Columns(), wait)  # taken, then lost
        raise MemoryError("injected")

    if where == "start":
        monkeypatch.setattr(lane.Prefetch, "start", staticmethod(start))
    else:
        monkeypatch.setattr(lane.Prefetch, "end", end)
    engines = [engine(f"e{k}", capacity=300) for k in range(3)]
    try:
        with sarp.open(tmp_path / "ix", durability="nosync") as index:
            sub = Subscriber(index, [Source(e.name, e.publisher.endpoint,
                                            e.publisher.replay_endpoint) for e in engines])
            _flood_and_follow(sub, index, engines, 13, 600)
            assert sub.prefetch_failures >= 1 and sub.prefetched == 0
            for e in engines:
                assert held(index, e.holder) == set(e.cache), e.name
            if where == "end":
                assert sum(s["gaps"] for s in sub.summary().values()) >= 1
            sub.close()
    finally:
        for e in engines:
            e.publisher.close()
