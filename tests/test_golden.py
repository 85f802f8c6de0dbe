"""Golden bytes: after a seeded stream of writes, every table and the snapshot hold
exactly the bytes recorded in ``vectors/golden.json``, on LMDB and on Valkey, through the
C path and through the Python one.  A refactor that changes one byte on disk fails here.

The tables are read past sarp (lmdb and valkey directly).  Two fields are left out as
they are made anew by every index: the index id (a uuid4, in ``meta`` and the snapshot
header, and so in the snapshot's checksum), and ``name_sums`` is kept by presence only
(a flag: Valkey once wrote it as one byte, LMDB as eight).

Regenerate (only for a deliberate format change, said in the commit):
``SARP_GOLDEN_WRITE=1 pytest tests/test_golden.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from pathlib import Path

import lmdb
import pytest
import valkey
from test_batch import engine_like_ops

import sarp
from sarp import native
from sarp.bench.valkey_server import ValkeyServer

VECTORS = Path(__file__).parent / "vectors" / "golden.json"
TABLES = ("meta", "segments", "blocks", "holders", "log")
_SNAP_ID_AT = 16  # the snapshot header: magic 8 B, version u32, reserved u32, index id 16 B


def write_stream(path: str, path_kind: str) -> None:
    """The seeded stream, in a child that then exits without closing (as a crash
    would, so the log keeps the entries after the snapshot): engine-like batches, an
    insert with meta, a clear, a snapshot, then more batches; on the ``"c"`` or the
    ``"python"`` path, which the child checks it took."""
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            with native.forced(path_kind), native.Tally() as tally:
                _stream(path)
            in_c, in_python = tally.c("pack_batch"), tally.python("pack_batch")
            # on C, the insert with meta and the clear are Python's all the same
            took = in_c > 0 if path_kind == "c" else in_c == 0 and in_python > 0
            code = 0 if took else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the stream failed, or took another path"


def _stream(path: str) -> None:
    ops = engine_like_ops(2024, 900)
    index = sarp.open(path, durability="nosync", segment_blocks=8,
                      snapshot_every_changes=1 << 40)
    for start in range(0, 600, 40):
        index.apply_batch(ops[start : start + 40])
    index.insert([7001, 7002, 7003], holder="m#0", medium="CPU", meta=[5, 6, 7])
    index.clear("b#0", "CPU")
    index.snapshot()
    for start in range(600, len(ops), 25):
        index.apply_batch(ops[start : start + 25])
    # not closed: the process ends as a crash would end it

def _digest(entries) -> str:
    h = hashlib.sha256()
    for key, value in entries:
        h.update(struct.pack("<I", len(key)) + key + struct.pack("<I", len(value)) + value)
    return h.hexdigest()


def _meta(entries: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return sorted((k, b"present" if k == b"name_sums" else v) for k, v in entries
                  if k != b"index_id")


def _snapshot(data: bytes) -> str:
    body = data[:_SNAP_ID_AT] + b"\0" * 16 + data[_SNAP_ID_AT + 16 : -8]  # no id, no checksum
    return hashlib.sha256(body).hexdigest()


def lmdb_digests(path: Path) -> dict[str, str]:
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8)
    try:
        out = {}
        with env.begin() as txn:
            for name in TABLES:
                db = env.open_db(name.encode(), txn=txn, create=False)
                entries = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
                out[name] = _digest(_meta(entries) if name == "meta" else entries)
    finally:
        env.close()
    out["snapshot"] = _snapshot((path / "directory.snap").read_bytes())
    return out


def valkey_digests(client, namespace: str) -> dict[str, str]:
    key = f"sarp:{{{namespace}}}:".encode()
    out = {}
    for name, suffix in (("meta", b"meta"), ("segments", b"seg"), ("blocks", b"blk"),
                         ("holders", b"hold")):
        entries = sorted(client.hgetall(key + suffix).items())
        out[name] = _digest(_meta(entries) if name == "meta" else entries)
    out["log"] = _digest((entry_id, fields[b"v"])
                         for entry_id, fields in client.xrange(key + b"log"))
    out["snapshot"] = _snapshot(client.get(key + b"snap"))
    return out


@pytest.fixture(scope="module")
def server():
    s = ValkeyServer()
    yield s
    s.stop()


def _paths() -> list[str]:
    return ["c", "python"] if native.AVAILABLE else ["python"]


@pytest.mark.parametrize("path_kind", _paths())
def test_lmdb_tables_and_snapshot_hold_the_golden_bytes(tmp_path, path_kind):
    write_stream(str(tmp_path / "ix"), path_kind)
    _check("lmdb", lmdb_digests(tmp_path / "ix"))


def test_valkey_keys_and_snapshot_hold_the_golden_bytes(server):
    # Valkey's writes run in Python on every build (its reads are round trips)
    namespace = f"g-{uuid.uuid4().hex[:10]}"
    write_stream(server.url(namespace), "python")
    client = valkey.Valkey(host="127.0.0.1", port=server.port)
    try:
        got = valkey_digests(client, namespace)
    finally:
        client.close()
    _check("valkey", got)


def _check(backend: str, got: dict[str, str]) -> None:
    if os.environ.get("SARP_GOLDEN_WRITE") == "1":
        vectors = json.loads(VECTORS.read_text()) if VECTORS.exists() else {}
        vectors[backend] = got
        VECTORS.write_text(json.dumps(vectors, indent=2, sort_keys=True) + "\n")
        return
    expected = json.loads(VECTORS.read_text())[backend]
    assert got == expected, {k: (got[k], expected[k]) for k in got if got[k] != expected[k]}
