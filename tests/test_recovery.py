"""Restarts in a fresh process: after close, after kill -9 mid-stream, and with the
snapshot deleted, truncated or bit-flipped.  Every block whose insert returned
before the crash must be matched afterwards, and no other block may be."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from servekit import Serve

import sarp

WRITER = textwrap.dedent(
    """
    import sys, sarp
    path, limit = sys.argv[1], int(sys.argv[2])
    index = sarp.open(path, segment_blocks=8, snapshot_every_changes=40)
    for i in range(limit):
        chain = [1000 + i % 5] + [10**6 + i * 100 + j for j in range(1 + i % 23)]
        index.insert(chain, holder=f"w{i % 3}", medium="GPU" if i % 2 else "CPU")
        print(i, flush=True)   # the insert has returned: it must survive
    index.close()
    print("closed", flush=True)
    """
)

CHECKER = textwrap.dedent(
    """
    import json, sys, sarp
    path, acked = sys.argv[1], int(sys.argv[2])
    with sarp.open(path) as index:
        stats = index.stats()
        missing, extra = [], []
        for i in range(acked + 200):
            chain = [1000 + i % 5] + [10**6 + i * 100 + j for j in range(1 + i % 23)]
            m = index.match(chain)
            holder = f"w{i % 3}"
            if i < acked and m.by_holder.get(holder, 0) != len(chain):
                missing.append(i)
            if i >= acked + 1 and m.num_blocks > 1:   # one in-flight insert may have landed
                extra.append(i)
        print(json.dumps({"missing": missing, "extra": extra, "problems": index.check(),
                          "recovered_from": stats["recovered_from"],
                          "reason": stats["recovery_reason"],
                          "replayed": stats["replayed_changes"]}))
    """
)


def run_writer(path: Path, limit: int, kill_after: int | None) -> int:
    """Run the writer; SIGKILL it after ``kill_after`` acknowledged inserts. Returns acks."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(limit)], stdout=subprocess.PIPE, text=True
    )
    acked = 0
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:
            if line.strip() == "closed":
                break
            acked = int(line) + 1
            if kill_after is not None and acked >= kill_after:
                os.kill(proc.pid, signal.SIGKILL)
                break
            assert time.monotonic() < deadline, "writer too slow"
    finally:
        proc.stdout.close()
        proc.wait(timeout=60)
    if kill_after is not None:
        assert proc.returncode == -signal.SIGKILL
    return acked


def run_checker(path: Path, acked: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHECKER, str(path), str(acked)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def assert_recovered(result: dict) -> None:
    assert result["missing"] == [], f"acknowledged inserts lost: {result['missing'][:10]}"
    assert result["extra"] == [], f"never-inserted chains matched: {result['extra'][:10]}"
    assert result["problems"] == []


def test_restart_after_close_loads_the_snapshot(tmp_path):
    acked = run_writer(tmp_path / "ix", 150, kill_after=None)
    assert acked == 150
    result = run_checker(tmp_path / "ix", acked)
    assert_recovered(result)
    assert result["recovered_from"] == "snapshot" and result["replayed"] == 0
    assert result["reason"] == ""


def test_kill_9_mid_stream_loses_no_returned_insert(tmp_path):
    acked = run_writer(tmp_path / "ix", 100_000, kill_after=230)
    result = run_checker(tmp_path / "ix", acked)
    assert_recovered(result)
    # Periodic snapshots were written, and the changes after the last one replayed.
    assert result["recovered_from"] == "snapshot"
    assert result["replayed"] > 0


@pytest.mark.parametrize("damage", ["delete", "truncate", "bitflip", "garbage"])
def test_a_damaged_snapshot_falls_back_to_a_rebuild(tmp_path, damage):
    acked = run_writer(tmp_path / "ix", 100_000, kill_after=120)
    snap = tmp_path / "ix" / "directory.snap"
    assert snap.exists()
    data = snap.read_bytes()
    if damage == "delete":
        snap.unlink()
    elif damage == "truncate":
        snap.write_bytes(data[: len(data) // 2])
    elif damage == "bitflip":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x10
        snap.write_bytes(bytes(flipped))
    else:
        snap.write_bytes(b"\0" * len(data))
    result = run_checker(tmp_path / "ix", acked)
    assert_recovered(result)
    assert result["recovered_from"] == "rebuild"
    expected = {"delete": "missing", "truncate": "bytes", "bitflip": "checksum",
                "garbage": "magic"}[damage]
    assert expected in result["reason"], result["reason"]


@pytest.mark.parametrize("readonly", [False, True])
def test_a_truncated_data_file_is_refused_before_lmdb_maps_it(tmp_path, readonly):
    # LMDB would touch pages past the end and die of SIGBUS; sarp checks the meta
    # pages against the file size first (in a child process, so a crash would show).
    import subprocess
    import sys

    path = tmp_path / "ix"
    with sarp.open(path, durability="nosync") as index:
        index.insert(list(range(1, 20_000)), holder="a")
    data = path / "data.mdb"
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 2)
    script = (f"import sarp\ntry:\n    sarp.open({str(path)!r}, readonly={readonly})\n"
              "except sarp.DamagedIndexError as exc:\n    print('refused:', exc)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "truncated" in out.stdout
    verify = subprocess.run([sys.executable, "-m", "sarp.cli", "verify", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode in (1, 2) and "truncated" in verify.stderr + verify.stdout


def test_a_data_file_without_lmdb_meta_pages_is_refused(tmp_path):
    path = tmp_path / "ix"
    with sarp.open(path) as index:
        index.insert([1, 2], holder="a")
    (path / "directory.snap").unlink()
    with (path / "data.mdb").open("r+b") as f:
        f.write(b"\0" * 16384)  # both meta pages gone
    with pytest.raises(sarp.DamagedIndexError, match="no valid LMDB meta page"):
        sarp.open(path)


def test_a_serve_that_rebuilt_its_directory_snapshots_it_at_its_first_idle_poll(tmp_path):
    """No usable snapshot at start (here: deleted) and no engine sending anything: serve
    writes one at its first idle poll, so that the next start, and each HTTP worker's
    open, loads it instead of reading every segment again."""
    path = tmp_path / "ix"
    rng = np.random.default_rng(7)
    with sarp.open(path, durability="nosync") as index:
        for _ in range(1200):  # a chain each: a segment each, past IDLE_SNAPSHOT_CHANGES
            index.insert(rng.integers(1, 1 << 63, 3, dtype=np.uint64), holder="e0#0")
    (path / "directory.snap").unlink()
    with Serve(path, [], workers=1, log=tmp_path / "serve.log") as serve:
        serve.wait_for(lambda: (path / "directory.snap").exists(), 30,
                       "a snapshot of the rebuilt directory")
        assert "rebuilding the directory" in serve.log.read_text()  # as it started


def test_serve_snapshots_while_busy_once_the_log_after_the_last_is_long():
    """serve's snapshot rule (``SnapshotRule``): under a stream with no idle poll, once
    the log after the last snapshot has BUSY_SNAPSHOT_CHANGES changes or the
    directory's entries if more, looked at once a second, a snapshot that keeps the
    log ("busy"); when idle or every --snapshot-every-s, the rules of before ("due":
    it trims); a store that is away means not now."""
    from sarp.errors import StoreError
    from sarp.serving.serve import BUSY_SNAPSHOT_CHANGES, SnapshotRule

    busy, due = SnapshotRule.BUSY, SnapshotRule.DUE
    looked = []

    def stats_of(changes: int, entries: int):
        def stats():
            looked.append(changes)
            return {"changes_since_snapshot": changes, "directory_entries": entries}
        return stats

    rule = SnapshotRule(60.0, now=0.0, rebuilt=False)
    assert rule.due(1.0, 5, stats_of(BUSY_SNAPSHOT_CHANGES - 1, 1000)) == ""
    assert rule.due(1.5, 5, stats_of(BUSY_SNAPSHOT_CHANGES, 1000)) == ""  # looked 0.5 s ago
    assert looked == [BUSY_SNAPSHOT_CHANGES - 1]
    assert rule.due(2.0, 5, stats_of(BUSY_SNAPSHOT_CHANGES, 1000)) == busy
    rule.taken(2.0)
    big = 4 * BUSY_SNAPSHOT_CHANGES  # a large directory: a pass over it per as many changes
    assert rule.due(3.0, 5, stats_of(big - 1, big)) == ""
    assert rule.due(4.0, 5, stats_of(big, big)) == busy
    rule.taken(4.0)

    def away():
        raise StoreError("the store is away")
    assert rule.due(5.0, 5, away) == ""  # not now, and no error out of the loop
    assert rule.due(64.0, 5, away) == due  # --snapshot-every-s whatever the store says

    idle = SnapshotRule(60.0, now=0.0, rebuilt=False)
    assert idle.due(0.5, 3, stats_of(10, 1000)) == ""  # busy, a short log: not yet
    assert idle.due(1.5, 0, stats_of(10, 1000)) == ""  # idle, the last 1.5 s old
    assert idle.due(2.0, 0, stats_of(10, 1000)) == due  # ... any change once it is 2 s old
    idle.taken(2.0)
    assert idle.due(2.5, 0, stats_of(10, 1000)) == ""  # nothing applied since: no look
    assert idle.due(3.5, 7, stats_of(0, 1000)) == ""
    assert idle.due(4.0, 0, stats_of(1000, 1000)) == due  # idle after IDLE_SNAPSHOT_CHANGES
    # a directory rebuilt at open counts as work at the first idle polls, engines or not
    assert SnapshotRule(60.0, 0.0, rebuilt=True).due(2.0, 0, stats_of(1, 10)) == due
    assert SnapshotRule(60.0, 0.0, rebuilt=False).due(2.0, 0, stats_of(1, 10)) == ""


def test_a_snapshot_that_keeps_the_log_is_loaded_and_the_log_after_it_replayed(tmp_path):
    """``snapshot(trim=False)`` (serve's busy snapshots): the log stays, a reader that
    was behind it replays it, and an open after a kill loads the snapshot and replays
    only what came after it."""
    path = tmp_path / "ix"
    probe = textwrap.dedent("""
        import sys, sarp
        with sarp.open(sys.argv[1], readonly=True) as ix:
            for line in sys.stdin:
                print(ix.recovered_from, *(ix.match(c).num_blocks for c in
                                           ([1, 2], [31, 32], [41, 42])), flush=True)
        """)
    writer = textwrap.dedent("""
        import os, sys, sarp
        ix = sarp.open(sys.argv[1], durability="nosync")
        for i in range(3):
            ix.insert([10 * i + 1, 10 * i + 2], holder="w0")
        ix.snapshot(trim=False)
        ix.insert([31, 32], holder="w0")
        ix.remove([1, 2], holder="w0")
        print(ix.stats()["log_watermark"], flush=True)
        sys.stdin.readline()
        ix.insert([41, 42], holder="w0")
        print("more", flush=True)
        sys.stdin.readline()
        os._exit(0)  # as if killed: no snapshot at a close
        """)
    w = subprocess.Popen([sys.executable, "-c", writer, str(path)], text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        w.stdout.readline()
        r = subprocess.Popen([sys.executable, "-c", probe, str(path)], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            r.stdin.write("\n")
            r.stdin.flush()
            assert r.stdout.readline().split() == ["snapshot", "0", "2", "0"]
            w.stdin.write("\n")
            w.stdin.flush()
            assert w.stdout.readline().strip() == "more"
            r.stdin.write("\n")
            r.stdin.flush()
            assert r.stdout.readline().split() == ["snapshot", "0", "2", "2"]
        finally:
            r.stdin.close()
            r.wait(30)
        w.stdin.write("\n")
        w.stdin.flush()
        assert w.wait(30) == 0
    finally:
        if w.poll() is None:
            w.kill()
    with sarp.open(path, durability="nosync") as index:  # the killed writer's index
        assert index.recovered_from == "snapshot"
        assert index.stats()["replayed_changes"] == 3  # 2 stores, 1 removal: not the 3 before
        assert [index.match(c).num_blocks for c in ([1, 2], [31, 32], [41, 42])] == [0, 2, 2]
        assert not index.check()
        with index._store.env.begin(db=index._store.log_db) as txn:
            assert txn.stat(index._store.log_db)["entries"] == 6  # the 3 before it kept


def test_a_trim_of_the_whole_log_empties_it_and_a_partial_one_keeps_what_follows(tmp_path):
    """LMDB's ``trim_log``: up to the newest entry (a snapshot's), the table emptied in
    one call; up to an older one, only what precedes; either way the trimmed mark is
    kept, later entries follow on, and a reader opened before (another process) catches
    up through them."""
    path = tmp_path / "ix"
    probe = textwrap.dedent("""
        import sys, sarp
        with sarp.open(sys.argv[1], readonly=True) as ix:
            for line in sys.stdin:
                print(*(ix.match(c).num_blocks for c in ([41, 42], [71, 72], [11, 12])),
                      flush=True)
        """)
    with sarp.open(path, durability="nosync") as index:
        for i in range(6):
            index.insert([10 * i + 1, 10 * i + 2], holder="w0")
        reader = subprocess.Popen([sys.executable, "-c", probe, str(path)], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            reader.stdin.write("\n")
            reader.stdin.flush()
            assert reader.stdout.readline().split() == ["2", "0", "2"]
            store = index._store
            newest = store.counter("next_seq")

            def log_keys() -> list[int]:
                with store.env.begin(db=store.log_db) as txn:
                    return [int.from_bytes(k, "big") for k, _ in txn.cursor()]

            keys = log_keys()
            assert len(keys) >= 6 and keys[-1] == newest
            store.trim_log(keys[2])  # an older entry: those after it stay
            assert log_keys() == keys[3:] and store.counter("log_trimmed_upto") == keys[2]
            index.snapshot()  # the newest: all of it
            assert log_keys() == [] and store.counter("log_trimmed_upto") == newest
            index.insert([71, 72], holder="w0")
            index.remove([11, 12], holder="w0")
            assert log_keys() and min(log_keys()) > newest
            reader.stdin.write("\n")
            reader.stdin.flush()
            assert reader.stdout.readline().split() == ["2", "2", "0"]
        finally:
            reader.stdin.close()
            reader.wait(30)


def test_a_rebuild_no_one_watches_does_not_import_the_progress_bar(tmp_path):
    """A reader that rebuilds its directory with stderr not a terminal (an HTTP
    worker after a kill -9 that left no snapshot) skips tqdm's import, 15-45 ms of its
    first answer; asked for a bar, it shows one."""
    with sarp.open(tmp_path / "ix") as index:
        index.insert([1, 2, 3], holder="w0")
    (tmp_path / "ix" / "directory.snap").unlink()
    probe = textwrap.dedent("""
        import sys, sarp
        with sarp.open(sys.argv[1], readonly=True, progress=sys.argv[2] == "bar") as ix:
            print(ix.recovered_from, ix.match([1, 2, 3]).num_blocks, "tqdm" in sys.modules)
        """)
    for bar, imported in (("none", "False"), ("bar", "True")):
        out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "ix"), bar],
                             capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.split() == ["rebuild", "3", imported], out.stderr


def test_many_directory_entries_added_at_once_are_each_added_in_turn():
    """``Directory.add_many`` (a reader's replay) against ``add`` one by one: over
    arrays, recent additions and removals, and hashes named twice, every lookup and
    the count agree."""
    from sarp.directory import Directory

    rng = np.random.default_rng(5)
    for _ in range(200):
        keys = rng.choice(np.arange(1, 60, dtype=np.uint64), int(rng.integers(0, 30)),
                          replace=False)
        start = Directory.from_entries(keys, rng.integers(0, 99, keys.size).astype(np.uint32))
        one, many = Directory(start.keys.copy(), start.segs.copy()), start
        for _ in range(int(rng.integers(0, 3))):  # changes not merged into the arrays yet
            for d in (one, many):
                if keys.size:
                    d.remove(int(keys[0]), int(d.lookup(int(keys[0])) or 0))
                d.add(70, 7)
        adds = rng.integers(1, 80, int(rng.integers(0, 40))).astype(np.uint64)
        segs = rng.integers(0, 99, adds.size).astype(np.int64)
        for first_hash, seg_id in zip(adds.tolist(), segs.tolist(), strict=True):
            one.add(first_hash, seg_id)
        many.add_many(adds, segs)
        assert len(many) == len(one)
        assert [many.lookup(k) for k in range(90)] == [one.lookup(k) for k in range(90)]


def test_a_compact_keeps_every_entry_and_drops_every_removed_one():
    """``Directory.compact`` (each snapshot merges the changes into the sorted arrays)
    against a dict of the same changes: entries, lookups and sortedness agree, over
    changes that hit the arrays, miss them, land past their ends and undo each other."""
    from sarp.directory import Directory

    rng = np.random.default_rng(11)
    for _ in range(300):
        keys = rng.choice(np.arange(10, 200, dtype=np.uint64), int(rng.integers(0, 40)),
                          replace=False)
        d = Directory.from_entries(keys, rng.integers(1, 99, keys.size).astype(np.uint32))
        model = d.entries()
        for _ in range(int(rng.integers(0, 60))):
            k = int(rng.integers(1, 260))  # below, inside and past the arrays' keys
            if k in model and rng.random() < 0.5:
                d.remove(k, model.pop(k))
            elif k not in model:
                model[k] = int(rng.integers(1, 99))
                d.add(k, model[k])
        d.compact()
        assert d.entries() == model and len(d) == len(model)
        assert d.keys.tolist() == sorted(model)
        assert [d.lookup(k) for k in range(270)] == [model.get(k) for k in range(270)]


class _Log:
    """A read transaction holding only what a replay reads: the log, records, a counter."""

    def __init__(self, entries: list[tuple[int, int, int]], records: dict[int, bytes | None],
                 next_seq: int) -> None:
        self.entries, self.records, self.next_seq = entries, records, next_seq

    def log_arrays(self, seq: int):
        from sarp.store import LOG_VALUE, U64, log_arrays

        return log_arrays([(U64.pack(s), LOG_VALUE.pack(g, f)) for s, g, f in self.entries
                           if s > seq])

    def counter(self, name: str) -> int:
        assert name == "next_seq"
        return self.next_seq

    def raw_records(self, seg_ids: list[int]) -> list[bytes | None]:
        return [self.records.get(s) for s in seg_ids]


def _replayed_one_by_one(memory, entries, records) -> None:
    """The replay as it was written first: segment by segment, in the order of each
    one's last entry (the reference the replay in arrays is held to)."""
    from sarp.errors import CorruptRecordError
    from sarp.segment import head

    latest: dict[int, list[int]] = {}
    for _, seg_id, first_hash in entries:
        logged = latest.pop(seg_id, [])
        logged += [] if first_hash in logged else [first_hash]
        latest[seg_id] = logged
    memory.filters.discard_many_everywhere(list(latest))
    for seg_id, logged in latest.items():
        try:
            found = None if records.get(seg_id) is None else head(seg_id, records[seg_id])
        except CorruptRecordError:
            found = None
        for first_hash in logged:
            if found is None or first_hash != found[0]:
                memory.directory.remove(first_hash, seg_id)
        if found is not None:
            memory.directory.add(found[0], seg_id)
            for holder_id in found[1]:
                memory.filters.add(holder_id, seg_id)


@pytest.mark.parametrize("seed", range(3))
def test_a_replay_in_arrays_leaves_memory_as_a_replay_segment_by_segment(seed):
    """Random logs over a directory already holding entries: segments logged again and
    again, ids logged under several first hashes (a tail's id taken again), segments
    gone and records damaged.  The directory and the holder filters end as the
    reference's; a missing entry is a LogHole before memory changes."""
    from sarp.recovery import LogHole, Memory, replay_log
    from sarp.segment import Segment

    rng = np.random.default_rng(seed)
    for _ in range(60):
        ids = [8 * int(i) for i in rng.choice(np.arange(1, 40), 25, replace=False)]
        first_of = {s: int(rng.integers(1, 30)) for s in ids}  # few hashes: they collide
        old_of = {s: int(rng.integers(1, 30)) for s in ids}  # what the id started with once
        memories = [Memory.empty(), Memory.empty()]
        for m in memories:
            for s in ids[:10]:
                m.directory.add(old_of[s], s)
                m.filters.add(1, s)
        entries = [(k + 1, s, old_of[s] if rng.random() < 0.3 else first_of[s])
                   for k, s in enumerate(rng.choice(ids, int(rng.integers(1, 50))).tolist())]
        records: dict[int, bytes | None] = {}
        for s in {s for _, s, _ in entries}:
            holders = rng.choice(np.arange(1, 6, dtype=np.uint16), int(rng.integers(1, 4)),
                                 replace=False)
            record = Segment(s, 0, None, np.array([first_of[s], 99], np.uint64), holders,
                             np.ones((holders.size, 2), np.uint8)).encode()
            kind = rng.random()
            records[s] = None if kind < 0.15 else record[:-1] + b"?" if kind < 0.25 else record
        _replayed_one_by_one(memories[0], entries, records)
        assert replay_log(_Log(entries, records, len(entries)), memories[1]) == len(entries)
        (want, got) = memories
        assert got.directory.entries() == want.directory.entries()
        assert len(got.directory) == len(want.directory)
        assert got.filters.as_sets() == want.filters.as_sets()
        assert got.watermark == len(entries)
        if len(entries) > 2:
            holed = Memory.empty()
            with pytest.raises(LogHole, match="log entry 2 is missing"):
                replay_log(_Log(entries[:1] + entries[2:], records, len(entries)), holed)
            assert holed.directory.entries() == {} and holed.watermark == 0
