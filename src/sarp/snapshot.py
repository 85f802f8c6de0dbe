"""Directory snapshots: the in-memory state on disk, so a restart maps it back.

File ``directory.snap``, little-endian::

    header    64 B  magic b"SARPSNAP", version u32, reserved u32, index id 16 B,
                    watermark u64 (last log sequence covered), num_entries u64,
                    holders_bytes u64, reserved u64
    keys      8n    directory keys (first block hashes), sorted
    segs      4n    segment ids, padded to 8
    holders         :meth:`HolderSegments.serialize`
    checksum  8     xxh3-64 of everything before it

Written atomically: temp file, fsync, rename, fsync the folder.  Loading maps the
file and checks its size, magic, version and checksum; any failure is a
:class:`SnapshotUnusable` carrying the reason, and the caller rebuilds instead.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .directory import Directory
from .filters import HolderSegments
from .hashing import Checksum, checksum

SNAPSHOT_FILE = "directory.snap"
SNAPSHOT_VERSION = 1
MAGIC = b"SARPSNAP"
_HEADER = struct.Struct("<8sII16sQQQQ")
_CHECKSUM = struct.Struct("<Q")


class SnapshotUnusable(Exception):
    """The snapshot is missing, damaged, or of another version; the reason is the message."""


@dataclass(slots=True)
class Snapshot:
    index_id: bytes
    watermark: int
    directory: Directory
    holders: HolderSegments


def encode(
    index_id: bytes, watermark: int, directory: Directory, holders: HolderSegments
) -> list[bytes]:
    """The snapshot as parts to write in order (the last one is the checksum).

    Cost: O(entries): the directory is compacted and written as raw arrays.
    """
    directory.compact()
    keys = np.ascontiguousarray(directory.keys, dtype="<u8").tobytes()
    segs = np.ascontiguousarray(directory.segs, dtype="<u4").tobytes()
    segs += b"\0" * (-len(segs) % 8)
    holder_bytes = holders.serialize()
    header = _HEADER.pack(
        MAGIC, SNAPSHOT_VERSION, 0, index_id, watermark, len(keys) // 8, len(holder_bytes), 0
    )
    parts = [header, keys, segs, holder_bytes]
    digest = Checksum()
    for part in parts:
        digest.update(part)
    return [*parts, _CHECKSUM.pack(digest.intdigest())]


def write(
    folder: Path, index_id: bytes, watermark: int, directory: Directory, holders: HolderSegments
) -> int:
    """Write the snapshot file atomically; return its size in bytes.

    Cost: O(entries), as :func:`encode`, plus one fsync of the file and the folder.
    """
    final = folder / SNAPSHOT_FILE
    tmp = folder / (SNAPSHOT_FILE + ".tmp")
    with open(tmp, "wb") as f:
        for part in encode(index_id, watermark, directory, holders):
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(tmp, final)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size


def load(folder: Path) -> Snapshot:
    """Map and check the snapshot file; raise :class:`SnapshotUnusable` with the reason.

    Cost: one pass over the file for the checksum; the directory arrays stay
    memory-mapped (no per-entry work).
    """
    path = folder / SNAPSHOT_FILE
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER.size + _CHECKSUM.size:
                raise SnapshotUnusable(f"{path}: {size} bytes is too short")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise SnapshotUnusable(f"{path}: missing") from None
    return decode(memoryview(buf), str(path))


def decode(view: memoryview | bytes, where: str) -> Snapshot:
    """Check and parse a snapshot held in memory (``where`` names it in errors).

    Cost: one xxh3 pass; the directory arrays are views of ``view``.
    """
    view = memoryview(view)
    size = len(view)
    if size < _HEADER.size + _CHECKSUM.size:
        raise SnapshotUnusable(f"{where}: {size} bytes is too short")
    magic, version, _, index_id, watermark, n, holder_bytes, _ = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise SnapshotUnusable(f"{where}: bad magic {magic!r}")
    if version != SNAPSHOT_VERSION:
        raise SnapshotUnusable(f"{where}: version {version}, this sarp reads {SNAPSHOT_VERSION}")
    keys_off = _HEADER.size
    segs_off = keys_off + 8 * n
    holders_off = segs_off + ((4 * n + 7) & ~7)
    end = holders_off + holder_bytes
    if end + _CHECKSUM.size != size:
        raise SnapshotUnusable(f"{where}: {size} bytes, header says {end + _CHECKSUM.size}")
    (stored,) = _CHECKSUM.unpack_from(view, end)
    if checksum(view[:end]) != stored:
        raise SnapshotUnusable(f"{where}: checksum mismatch")
    directory = Directory(
        np.frombuffer(view, "<u8", n, keys_off), np.frombuffer(view, "<u4", n, segs_off)
    )
    holders = HolderSegments.deserialize(view[holders_off:end])
    return Snapshot(bytes(index_id), watermark, directory, holders)


def remove(folder: Path) -> None:
    """Delete the snapshot (it is derived state; the store is the truth)."""
    for name in (SNAPSHOT_FILE, SNAPSHOT_FILE + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / name)
