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
