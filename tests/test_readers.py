"""Readers in other processes beside a writer: `sarp.open(path, readonly=True)`.

Real processes (spawned), a real LMDB file.  After every acknowledged write, each
reader's next answer must equal an exact model of what the writer holds: no stale
answer, no false positive, across snapshots with log trims, map growth and a writer
restart.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import random
import subprocess
import sys

import pytest

import sarp

NUM_READERS = 2


def reader_main(path: str, conn) -> None:
    """A reader process: answer each batch of queries with by_holder per query."""
    index = sarp.open(path, readonly=True)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg == "stats":
                stats = index.stats()
                conn.send(stats["snapshot_reloads"] + stats["reader_rebuilds"])
                continue
            if msg == "write":
                try:
                    index.insert([1], holder="intruder")
                    conn.send("accepted")
                except sarp.ReadOnlyIndexError as exc:
                    conn.send(f"refused: {exc}")
                continue
            conn.send([index.match(q).by_holder for q in msg])
    finally:
        index.close()
        conn.close()


class Model:
    """What the writer holds: holder -> set of blocks; answers by_holder exactly."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def by_holder(self, query: list[int]) -> dict[str, int]:
        out = {}
        for holder, blocks in self.held.items():
            n = 0
            while n < len(query) and query[n] in blocks:
                n += 1
            if n:
                out[holder] = n
        return out


def test_readers_in_other_processes_see_every_acknowledged_write(where):
    path = where("ix")
    rng = random.Random(3)
    writer = sarp.open(path, durability="nosync", map_size_bytes=1 << 20,
                       snapshot_every_changes=40, segment_blocks=16)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(NUM_READERS):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=reader_main, args=(path, there), daemon=True)
        proc.start()
        pipes.append(here)
        procs.append(proc)
    model = Model()
    chains: list[list[int]] = []  # every chain ever stored, for queries
    holders = ["e0#0", "e1#0", "e2#1"]
    lmdb_map = getattr(writer._store, "env", None)  # LMDB grows its map meanwhile
    first_map = lmdb_map.info()["map_size"] if lmdb_map is not None else None
    stale = held_answers = 0
    done = {"snapshot": 0, "restart": 0}
    try:
        for _step in range(160):
            op = rng.random()
            holder = rng.choice(holders)
            if op < 0.55 or not chains:
                base = rng.choice(chains) if chains and rng.random() < 0.6 else []
                cut = rng.randrange(len(base) + 1)
                new = [rng.getrandbits(62) + 1 for _ in range(rng.randrange(1, 60))]
                prefix = base[:cut]
                # Insert the holder's whole prefix first (idempotent for held blocks).
                writer.insert(prefix + new, holder=holder, medium="GPU")
                chains.append(prefix + new)
                model.held.setdefault(holder, set()).update(prefix + new)
            elif op < 0.85:
                chain = rng.choice(chains)
                gone = chain[rng.randrange(len(chain)):]
                writer.remove(gone, holder=holder, medium="GPU")
                model.held.setdefault(holder, set()).difference_update(gone)
            elif op < 0.93:
                writer.clear(holder)
                model.held[holder] = set()
            elif op < 0.97:
                writer.snapshot()  # and trim the log the readers follow
                done["snapshot"] += 1
            else:
                writer.close()  # a writer restart, readers staying
                writer = sarp.open(path, durability="nosync", segment_blocks=16,
                                   snapshot_every_changes=40)
                done["restart"] += 1
            queries = [rng.choice(chains) + [12345] for _ in range(8)]
            expected = [model.by_holder(q) for q in queries]
            for conn in pipes:
                conn.send(queries)
            for conn in pipes:
                got = conn.recv()
                stale += sum(g != e for g, e in zip(got, expected, strict=True))
                held_answers += sum(bool(e) for e in expected)
        assert stale == 0, f"{stale} answers differed from the writer's acknowledged state"
        if first_map is not None:
            assert writer._store.env.info()["map_size"] > first_map  # the map grew meanwhile
        assert done["snapshot"] >= 2 and done["restart"] >= 2, done
        for conn in pipes:
            conn.send("stats")
            assert conn.recv() > 0  # the log was trimmed past a reader: it reloaded
            conn.send("write")
            assert conn.recv().startswith("refused:")
        assert writer.check() == []
    finally:
        for conn in pipes:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
        writer.close()
    assert held_answers > 500  # most comparisons were of blocks held, not of empty answers


def test_a_reader_refuses_writes_and_changes_nothing(where):
    with sarp.open(where("ix")) as writer:
        writer.insert([1, 2], holder="a")
    reader = sarp.open(where("ix"), readonly=True)
    try:
        for call in (lambda: reader.insert([3], parent=2, holder="a"),
                     lambda: reader.remove([2], holder="a"),
                     lambda: reader.clear("a"),
                     reader.snapshot):
            with pytest.raises(sarp.ReadOnlyIndexError, match="readonly=True"):
                call()
        assert reader.match([1, 2, 3]).by_holder == {"a": 2}
        assert reader.stats()["readonly"] is True
    finally:
        reader.close()
    with sarp.open(where("ix")) as writer:
        assert writer.match([1, 2, 3]).by_holder == {"a": 2}


_MANY_READER = """
import json, sys, sarp
reader = sarp.open(sys.argv[1], readonly=True)
for line in sys.stdin:
    got = reader.match_many(json.loads(line))
    print(json.dumps([[m.num_blocks, m.by_holder] for m in got]), flush=True)
"""


def test_match_many_on_a_reader_in_another_process_sees_every_returned_write(where):
    writer = sarp.open(where("ix"), durability="nosync")
    reader = subprocess.Popen([sys.executable, "-c", _MANY_READER, where("ix")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(chains):
        reader.stdin.write(json.dumps(chains) + "\n")
        reader.stdin.flush()
        return json.loads(reader.stdout.readline())

    try:
        assert ask([[1, 2], [5]]) == [[0, {}], [0, {}]]
        writer.insert([1, 2, 3], holder="a")
        writer.insert([5, 6], holder="b", medium="CPU")
        writer.remove([3], holder="a")
        assert ask([[1, 2, 3], [5, 6, 7], [9]]) == [[2, {"a": 2}], [2, {"b": 2}], [0, {}]]
        writer.clear("b")
        assert ask([[5, 6], [1]]) == [[0, {}], [1, {"a": 1}]]
    finally:
        reader.stdin.close()
        reader.wait(timeout=30)
        writer.close()


def test_a_second_open_in_the_same_process_is_a_clear_error(tmp_path):
    with sarp.open(tmp_path / "ix") as writer:
        writer.insert([1], holder="a")
        with pytest.raises(sarp.IndexLockedError, match="already open in this process"):
            sarp.open(tmp_path / "ix", readonly=True)


def test_a_reader_of_a_folder_that_is_not_an_index_gets_a_clear_error(tmp_path):
    with pytest.raises(sarp.NotAnIndexError, match="start the writer"):
        sarp.open(tmp_path / "nothing-here", readonly=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(sarp.NotAnIndexError, match="no data.mdb"):
        sarp.open(tmp_path / "empty", readonly=True)
    assert not (tmp_path / "nothing-here").exists()  # a reader creates nothing


def test_a_reader_of_an_index_without_a_table_is_told_which_and_the_fix(tmp_path):
    """An index written before its ``state`` table: a reader names the table and says
    that one writable open adds it; after that open it reads."""
    import lmdb

    with sarp.open(tmp_path / "ix") as writer:
        writer.insert([1, 2], holder="a")
    env = lmdb.open(str(tmp_path / "ix"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"state", txn=txn), delete=True)
    env.close()
    with pytest.raises(sarp.NotAnIndexError, match="no 'state' table.*without readonly"):
        sarp.open(tmp_path / "ix", readonly=True)
    sarp.open(tmp_path / "ix").close()
    with sarp.open(tmp_path / "ix", readonly=True) as reader:
        assert reader.match([1, 2]).by_holder == {"a": 2}
        assert reader.read_state("subscriber.json") is None


def test_more_readers_than_the_reader_table_is_a_clear_error(tmp_path):
    # LMDB rounds the table up to fill its lock page (about 60 slots for max_readers=2),
    # so a reader process holds read transactions until the table is full.
    path = str(tmp_path / "ix")
    with sarp.open(path, max_readers=2) as writer:  # the first to open sets the table
        writer.insert([1], holder="a")
        script = (
            "import sarp\n"
            f"ix = sarp.open({path!r}, readonly=True)\n"
            "held = []\n"
            "try:\n"
            "    for _ in range(10_000):\n"
            "        held.append(ix._store.read().__enter__())\n"
            "except sarp.ReadersFullError as exc:\n"
            "    print(len(held), exc)\n"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 0, out.stderr
    count, message = out.stdout.split(" ", 1)
    assert 1 < int(count) < 10_000
    assert "reader table is full" in message and "max_readers" in message


def test_verify_and_stats_work_beside_a_running_writer(tmp_path):
    path = tmp_path / "ix"
    with sarp.open(path, durability="nosync") as writer:
        writer.insert([1, 2, 3], holder="a")
        for command in ("verify", "stats"):
            out = subprocess.run([sys.executable, "-m", "sarp.cli", command, str(path)],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
        assert '"blocks": 3' in out.stdout


_PINNING_READER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8)
txn = env.begin()  # a read transaction, as a worker holds one mid-match
print("pinned", flush=True)
time.sleep(600)
"""


def test_a_reader_killed_inside_a_transaction_stops_pinning_pages_once_released(tmp_path):
    """A process killed mid-read leaves its LMDB reader slot behind, and the pages it
    pins are never reused: every write grows the file.  The writer frees such slots
    (at open, at each snapshot, and serve when it replaces a worker)."""
    import signal

    path = tmp_path / "ix"
    data = path / "data.mdb"

    def churn(index, start: int) -> int:
        before = data.stat().st_size
        for k in range(start, start + 300):
            chain = list(range(10_000 * k + 1, 10_000 * k + 60))
            index.insert(chain, holder="w0")
            index.remove(chain, holder="w0")
        return data.stat().st_size - before

    with sarp.open(path, durability="nosync", segment_blocks=8) as index:
        churn(index, 1)  # the file at its working size
        reader = subprocess.Popen([sys.executable, "-c", _PINNING_READER, str(path)],
                                  stdout=subprocess.PIPE, text=True)
        assert reader.stdout.readline().strip() == "pinned"
        reader.send_signal(signal.SIGKILL)
        reader.wait(timeout=10)
        pinned = churn(index, 1000)
        assert index.release_dead_readers() == 1
        churn(index, 2000)  # the pinned pages come free here
        released = churn(index, 3000)
        assert pinned > 0 and released < pinned / 4, (pinned, released)
        assert index.release_dead_readers() == 0
