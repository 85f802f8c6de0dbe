"""The invariant checker and `sarp verify`, on stores damaged on purpose."""

from __future__ import annotations

import struct
import subprocess
import sys

import lmdb

import sarp


def build(path):
    with sarp.open(path, segment_blocks=4, durability="nosync") as index:
        index.insert(list(range(1, 11)), holder="w0")  # segments 8 [1-4], 16 [5-8], 24 [9-10]
        # [3, 4] moves to segment 9, beside 8 in key order, and 50, 51 join segment 8
        index.insert([50, 51], parent=2, holder="w1")
        assert index.check() == []


class Raw:
    """One table of a closed index, read and changed past sarp: LMDB's environment, or
    the namespace's hash on Valkey."""

    def __init__(self, path: str, table: str) -> None:
        self.valkey = "://" in path
        if self.valkey:
            import valkey

            from sarp.store import parse_url

            settings = parse_url(path)
            self.client = valkey.Valkey(host=settings["host"], port=settings["port"])
            short = {"segments": "seg", "blocks": "blk", "holders": "hold"}[table]
            self.key = f"sarp:{{{settings['namespace']}}}:{short}"
        else:
            self.env = lmdb.open(path, max_dbs=8)
            self.db = self.env.open_db(table.encode())

    def first(self) -> tuple[bytes, bytearray]:
        if self.valkey:
            key = min(self.client.hkeys(self.key))
            return key, bytearray(self.client.hget(self.key, key))
        with self.env.begin(db=self.db) as txn:
            key, value = next(iter(txn.cursor()))
            return bytes(key), bytearray(value)

    def items(self) -> list[tuple[bytes, bytes]]:
        if self.valkey:
            return sorted(self.client.hgetall(self.key).items())
        with self.env.begin(db=self.db) as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]

    def put(self, key: bytes, value: bytes) -> None:
        if self.valkey:
            self.client.hset(self.key, key, value)
        else:
            with self.env.begin(write=True, db=self.db) as txn:
                txn.put(key, value)

    def delete(self, key: bytes) -> None:
        if self.valkey:
            self.client.hdel(self.key, key)
        else:
            with self.env.begin(write=True, db=self.db) as txn:
                txn.delete(key)

    def close(self) -> None:
        (self.client if self.valkey else self.env).close()


def damage(path, table: str, fn) -> None:
    """Change ``table`` of the closed index at ``path`` with ``fn(raw)``."""
    raw = Raw(str(path), table)
    try:
        fn(raw)
    finally:
        raw.close()


def verify(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sarp.cli", "verify", str(path)],
                          capture_output=True, text=True)


def test_a_flipped_byte_in_a_segment_is_reported_and_never_matched(where):
    path = where("ix")
    build(path)

    def flip(raw):
        key, record = raw.first()
        record[30] ^= 0xFF  # inside the hashes of segment 8, the first
        raw.put(key, bytes(record))

    damage(path, "segments", flip)
    out = verify(path)
    assert out.returncode == 1
    assert "segment 8: checksum mismatch" in out.stdout
    with sarp.open(path) as index:
        m = index.match(list(range(1, 11)))
        assert m.num_blocks == 0  # the damaged first segment ends the verified prefix
        assert index.stats()["corrupt_records"] == 1


def test_a_rebuild_skips_a_damaged_segment_and_keeps_every_other(tmp_path, caplog):
    """A directory rebuilt from the segments (no snapshot) checks their records in one
    call per chunk: the damaged one is left out and named in a warning, and every
    other entry and holder filter is the snapshot's."""
    path = tmp_path / "ix"
    build(path)
    with sarp.open(path, readonly=True) as index:
        assert index.recovered_from == "snapshot"
        entries, filters = index.directory.entries(), index.holders.as_sets()
    damage(path, "segments", lambda raw: raw.put(struct.pack(">Q", 16), b"SG" + b"\0" * 40))
    (path / "directory.snap").unlink()
    with caplog.at_level("WARNING", logger="sarp"), sarp.open(path, readonly=True) as index:
        assert index.recovered_from == "rebuild"
        assert index.directory.entries() == {h: s for h, s in entries.items() if s != 16}
        assert index.holders.as_sets() == {h: s - {16} for h, s in filters.items()}
        assert index.blocks_of("w0").tolist() == [1, 2, 3, 4, 9, 10]  # not 16's [5-8]
        assert index.blocks_of("w1").tolist() == [50, 51]
    assert "rebuild skips segment 16: checksum mismatch" in caplog.text


def test_every_problem_is_reported_with_its_location(where):
    path = where("ix")
    build(path)
    damage(path, "blocks", lambda raw: raw.delete(struct.pack(">Q", 6)))  # block 6's entry
    damage(path, "blocks", lambda raw: raw.put(struct.pack(">Q", 999),
                                               struct.pack("<IH", 77, 0)))
    out = verify(path)
    assert out.returncode == 1
    assert "blocks table: 6 missing, stored in segment 16 at 1" in out.stdout
    assert "blocks table: 999 -> (77, 0), segments say None" in out.stdout
    assert "2 problem(s)" in out.stdout


def test_verify_of_a_sound_index_and_of_a_missing_path(tmp_path):
    build(tmp_path / "ix")
    out = verify(tmp_path / "ix")
    assert out.returncode == 0 and "0 problem(s)" in out.stdout
    out = verify(tmp_path / "nope")
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_a_directory_out_of_step_with_the_store_is_reported(tmp_path):
    build(tmp_path / "ix")
    with sarp.open(tmp_path / "ix") as index:
        index.directory.add(12345, 2)  # a stray entry, as a bug would leave it
        problems = index.check()
        assert any("directory: 12345 -> 2" in p for p in problems)
        index.holders.add(1, 3)  # w1 holds only 50, 51 (appended to segment 1), not [9, 10]
        problems = index.check()
        assert any(p.startswith("holder filter 1: extra segments [3]") for p in problems)


def test_a_changed_byte_in_a_holder_name_is_never_reported_as_a_holder(where):
    # The damage of issue 12: one byte of a stored holder name changed made queries
    # report blocks under a holder that holds nothing, and verify said 0 problems.
    path = where("ix")
    with sarp.open(path, durability="nosync") as index:
        index.insert([1, 2, 3], holder="w0")
        index.insert([1, 2], holder="w1")

    def rename(raw):
        for key, value in raw.items():
            if key.startswith(b"i:") and value.startswith(b"w0"):
                raw.put(key, b"w9" + value[2:])  # w0 -> w9: one byte
                return
        raise AssertionError("no holder w0")

    damage(path, "holders", rename)
    out = verify(path)
    assert out.returncode == 1 and "fails its checksum" in out.stdout
    with sarp.open(path, readonly=True) as reader:  # a reader: reports no w9, no w0
        assert reader.match([1, 2, 3]).by_holder == {"w1": 2}
    with sarp.open(path) as index:  # the writer drops the damaged holder's blocks
        m = index.match([1, 2, 3])
        assert m.by_holder == {"w1": 2} and m.num_blocks == 2
        assert index.holders_list() == [("w1", "GPU")]
        index.insert([1, 2, 3], holder="w0")  # the engine stores again: a new holder id
        assert index.match([1, 2, 3]).by_holder == {"w0": 3, "w1": 2}


def test_a_damaged_tree_page_is_a_sarp_error_not_a_raw_lmdb_one(tmp_path):
    # Zero a page in the middle of data.mdb (one of the blocks table's pages), with
    # the snapshot gone; in a child process, since LMDB may also abort on it.
    path = tmp_path / "ix"
    with sarp.open(path, durability="nosync") as index:
        index.insert(list(range(1, 30_000)), holder="w0")
    (path / "directory.snap").unlink()
    data = path / "data.mdb"
    size = data.stat().st_size
    with data.open("r+b") as f:
        f.seek((size // 4096 // 2) * 4096)
        f.write(b"\0" * 4096)
    out = verify(path)
    assert out.returncode == 1  # a report, whatever LMDB made of the page
    assert "problem(s)" in out.stdout and "Traceback" not in out.stderr
