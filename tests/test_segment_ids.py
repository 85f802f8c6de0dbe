"""Segment ids: a new segment takes every ID_STRIDE-th id, a tail split off it the ids
after, so the tail's record sits beside its segment's; an id whose segment died is
taken again, and every reader of the log follows it (on the C write path and the
Python one alike)."""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import subprocess
import sys

import lmdb
import pytest

import sarp
from sarp.store import ID_STRIDE


def segment_of(path, block: int) -> int | None:
    """The segment id the ``blocks`` table names for ``block``, read past sarp."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8)
    try:
        with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
            value = txn.get(struct.pack(">Q", block))
    finally:
        env.close()
    return None if value is None else struct.unpack("<IH", value)[0]


def build(path, **kw):
    index = sarp.open(path, segment_blocks=4, durability="nosync", **kw)
    index.insert(list(range(1, 11)), holder="w0")  # [1-4] [5-8] [9-10]
    return index


def test_new_segments_take_every_stride_th_id_and_a_tail_the_next(tmp_path):
    path = tmp_path / "ix"
    with build(path) as index:
        index.insert([50, 51], parent=2, holder="w1")  # moves [3, 4] out of [1-4]
        index.insert([60], parent=1, holder="w2")  # moves [2, 50, 51] out
        assert index.check() == []
        assert index.match([1, 2, 3, 4, 5]).by_holder == {"w0": 5}
    first = segment_of(path, 1)
    assert first == ID_STRIDE
    assert [segment_of(path, b) for b in (5, 9)] == [2 * ID_STRIDE, 3 * ID_STRIDE]
    assert segment_of(path, 3) == first + 1  # the first tail, beside its segment
    assert segment_of(path, 2) == first + 2  # the second
    assert segment_of(path, 60) == first


def test_when_the_ids_after_a_segment_are_taken_a_tail_takes_a_new_one(tmp_path):
    path = tmp_path / "ix"
    with sarp.open(path, segment_blocks=64, durability="nosync") as index:
        index.insert(list(range(1, 41)), holder="w0")
        # each branch 3 blocks before the end moves those 3 blocks out of segment 8
        ends = []
        for turn in range(ID_STRIDE):
            end = 40 - 2 * (turn + 1)
            index.insert([1000 + turn], parent=end - 1, holder="w1")
            ends.append(end)
        assert index.check() == []
    first = segment_of(path, 1)
    tails = [segment_of(path, end) for end in ends]
    assert tails[: ID_STRIDE - 1] == list(range(first + 1, first + ID_STRIDE))
    assert tails[-1] % ID_STRIDE == 0 and tails[-1] > first  # no id left beside it


def reader_main(path: str, conn) -> None:
    """A reader process: answers ("match", chain), ("lookup", hash) and ("check",)."""
    index = sarp.open(path, readonly=True)
    try:
        while (msg := conn.recv()) is not None:
            if msg[0] == "match":
                conn.send(index.match(msg[1]).by_holder)
            elif msg[0] == "lookup":
                index.match([msg[1]])  # catch up with the writer first
                conn.send(index.directory.lookup(msg[1]))
            else:
                conn.send(index.check())
    finally:
        index.close()


def test_a_dead_tails_id_is_taken_again_and_readers_follow_it(tmp_path):
    path = tmp_path / "ix"
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    writer = build(path)
    proc = ctx.Process(target=reader_main, args=(str(path), there), daemon=True)
    try:
        writer.insert([50, 51], parent=2, holder="w1")  # tail [3, 4] -> the id after 8
        tail = writer.directory.lookup(3)
        assert tail == writer.directory.lookup(1) + 1
        proc.start()

        def ask(*msg):
            here.send(msg)
            return here.recv()

        assert ask("match", [1, 2, 3, 4]) == {"w0": 4}
        assert ask("lookup", 3) == tail  # the reader's directory names the tail
        writer.remove([3, 4], holder="w0")  # the tail's segment dies
        writer.insert([80], parent=1, holder="w3")  # moves [2, 50, 51] out: same id
        assert writer.directory.lookup(2) == tail and writer.directory.lookup(3) is None
        for chain in ([1, 2, 3, 4], [1, 2, 50, 51], [1, 80]):
            assert ask("match", chain) == writer.match(chain).by_holder
        # the dead tail's first block no longer names the id it had
        assert ask("lookup", 3) is None
        assert ask("lookup", 2) == tail
        assert ask("check") == []
        here.send(None)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
        writer.close()
    with sarp.open(path) as again:  # recovery replays the same log
        assert again.directory.lookup(3) is None and again.directory.lookup(2) == tail
        assert again.check() == []


@pytest.mark.skipif(not __import__("sarp.native").native.AVAILABLE,
                    reason="the C write path is not built here")
def test_the_python_write_path_takes_the_same_ids(tmp_path):
    # The same writes through the Python reference path (SARP_PURE_PYTHON=1) name the
    # same segments as the C path did; each run reports the path it took.
    script = (
        "import sys, sarp\n"
        "from sarp import native\n"
        "ix = sarp.open(sys.argv[1], segment_blocks=4, durability='nosync')\n"
        "ix.insert(list(range(1, 11)), holder='w0')\n"
        "ix.insert([50, 51], parent=2, holder='w1')\n"
        "ix.insert([60], parent=1, holder='w2')\n"
        "ix.close()\n"
        "print(*native.calls()['pack_batch'])\n")
    ran = {}
    for name, pure in (("c", "0"), ("py", "1")):
        env = {**os.environ, "SARP_PURE_PYTHON": pure}
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], env=env,
                             check=True, timeout=60, capture_output=True, text=True)
        ran[name] = tuple(map(int, out.stdout.split()))
    assert ran["c"][0] == 3 and ran["c"][1] == 0  # "0" is not pure Python
    assert ran["py"][0] == 0 and ran["py"][1] == 3
    blocks = [1, 2, 3, 4, 5, 9, 50, 51, 60]
    assert [segment_of(tmp_path / "c", b) for b in blocks] == \
        [segment_of(tmp_path / "py", b) for b in blocks]
    from sarp import native  # the stride and bound C was built with are Python's
    from sarp.store import MAX_SEGMENT_ID
    with native.forced("c"):
        assert native.C.SEG_ID_STRIDE == ID_STRIDE
        assert native.C.MAX_SEGMENT_ID == MAX_SEGMENT_ID
