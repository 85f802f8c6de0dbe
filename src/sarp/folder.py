"""An index folder on disk, as the LMDB backend keeps it: its two writer locks, the data
file checked before LMDB maps it, and the room left when a write fails.  No lmdb here:
these read the folder and the file as bytes (:mod:`sarp.store_lmdb` is the one module
that imports lmdb).

Files: ``data.mdb`` and ``lock.mdb`` (LMDB's), ``sarp.lock`` (the writer's pid, locked),
and ``directory.snap`` (:mod:`sarp.snapshot`).
"""

from __future__ import annotations

import fcntl
import os
import resource
import struct
from pathlib import Path

from .errors import DamagedIndexError, IndexLockedError, NotAnIndexError, ReadersFullError

LOCK_FILE = "sarp.lock"
LOW_DISK_BYTES = 64 << 20  # a failed write with less room than this is a full disk


def check_path(path: Path, create: bool) -> None:
    if path.exists() and not path.is_dir():
        raise NotAnIndexError(f"{path} is a file, not a sarp index directory; pass a directory")
    if not path.exists():
        if not create:
            raise NotAnIndexError(f"{path} does not exist; pass create=True to make a new index")
        return
    names = {p.name for p in path.iterdir()} - {LOCK_FILE}
    if names and "data.mdb" not in names:
        raise NotAnIndexError(
            f"{path} is a non-empty directory without a sarp index ({sorted(names)[:5]}); "
            "pass a new or empty directory"
        )


REPAIR_HINT = ("Salvage what can be read with: sarp repair {path} --out NEW_FOLDER "
                "(or restore a copy; sarp serve can also rebuild it from the engines' "
                "replay buffers)")


_LMDB_MAGIC = 0xBEEFC0DE


_PAGE_HEADER_BYTES = 16


_META = struct.Struct("<IIQQIHH")  # magic, version, address, map size, then the free DB


_META_TAIL = struct.Struct("<QQ")  # last page number, transaction id (after both DBs)


_META_TAIL_AT = _PAGE_HEADER_BYTES + 24 + 2 * 48


# md_root of the free-page DB and of the main DB: the last field of each 48-byte MDB_db
_ROOTS_AT = (_PAGE_HEADER_BYTES + 24 + 40, _PAGE_HEADER_BYTES + 24 + 48 + 40)


_U64_LE = struct.Struct("<Q")


_NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty tree


def check_data_file(data: Path) -> None:
    """Refuse an LMDB file that is truncated or is not LMDB, before LMDB maps it.

    LMDB trusts its file: a tree page past the end of ``data.mdb`` kills the process
    with SIGBUS when it is touched, and a damaged meta page trips an assertion
    (abort).  The newer valid meta page names the root page of each of LMDB's two
    trees (the free-page tree and the main one, which holds sarp's tables); a root
    past the end of the file, or a file that ends inside a page, means it was
    truncated.  (The meta's "last page" is no bound: LMDB may count pages a
    transaction allocated and freed again without ever writing them.)  Cost: one
    read of two pages.
    """
    try:
        size = data.stat().st_size
        page_size, roots = tree_roots(data)
    except FileNotFoundError:
        return
    if page_size < 512:
        raise DamagedIndexError(
            f"{data}: no valid LMDB meta page ({size} bytes); the file is damaged or is not "
            f"an index. {REPAIR_HINT.format(path=data.parent)}"
        )
    pages = size // page_size
    if size % page_size:
        # LMDB writes whole pages: a file that ends inside one was cut short.
        raise DamagedIndexError(
            f"{data}: {size} bytes is not a whole number of {page_size}-byte pages: the file "
            f"was truncated. {REPAIR_HINT.format(path=data.parent)}"
        )
    beyond = [r for r in roots if r != _NO_PAGE and r >= pages]
    if beyond:
        raise DamagedIndexError(
            f"{data}: {size} bytes ({pages} pages), but its last committed transaction has a "
            f"tree root at page {beyond[0]}: the file was truncated. "
            f"{REPAIR_HINT.format(path=data.parent)}"
        )


def tree_roots(data: Path) -> tuple[int, list[int]]:
    """The page size and the root pages of LMDB's two trees (free pages, main) in the
    newer valid meta page of ``data`` (``P_INVALID`` for an empty tree); page size 0
    when neither meta page is valid.  Cost: one read of two pages.

    >>> tree_roots(Path("/dev/null"))
    (0, [])
    """
    page_size, meta = _newer_meta(data)
    return (page_size, meta[0]) if meta else (0, [])


def cover_last_page(data: Path) -> int:
    """Append zero pages to ``data`` up to the last page its newer meta page counts;
    how many (0 for a whole file).  For a writer, under its locks (no one else writes
    the file, so the size read cannot move under the truncate).

    A file cut short past its trees' roots passes :func:`check_data_file`, and the
    first touch of a lost page killed the process with SIGBUS.  Zero pages instead
    read as damaged: LMDB answers ``MDB_CORRUPTED``, which sarp reports as
    ``DamagedIndexError`` naming ``sarp repair`` on a read and as a failed write on a
    write, and serve goes on.  LMDB may also count a few pages it allocated and never
    wrote: those are free, and a zero page there is never read.  A meta page whose
    last page lies past its own map size is left to LMDB (damaged, not cut).  Cost: a
    read of two pages and a stat; a truncate when short.

    >>> cover_last_page(Path("/dev/null"))
    0
    """
    page_size, meta = _newer_meta(data)
    if not meta:
        return 0
    _, last_page, map_size = meta
    want, size = (last_page + 1) * page_size, data.stat().st_size
    if size >= want or want > map_size or size % page_size:
        return 0
    try:
        os.truncate(data, want)
    except OSError:
        return 0  # as before: the first read of a lost page is the process's end
    return (want - size) // page_size


def _newer_meta(data: Path) -> tuple[int, tuple[list[int], int, int] | None]:
    """The page size, and the newer valid meta page's tree roots, last page and map
    size (None when neither is valid)."""
    with data.open("rb") as f:
        head = f.read(2 * 65536)
    metas = []
    first = _META.unpack_from(head, _PAGE_HEADER_BYTES) if len(head) >= 64 else None
    page_size = first[4] if first and first[0] == _LMDB_MAGIC else 0
    for at in (0, page_size) if page_size else (0,):
        if at + _META_TAIL_AT + _META_TAIL.size > len(head):
            continue
        magic, _, _, map_size = _META.unpack_from(head, at + _PAGE_HEADER_BYTES)[:4]
        if magic == _LMDB_MAGIC:
            roots = [_U64_LE.unpack_from(head, at + off)[0] for off in _ROOTS_AT]
            last_page, txnid = _META_TAIL.unpack_from(head, at + _META_TAIL_AT)
            metas.append((txnid, (roots, last_page, map_size)))
    return page_size, max(metas)[1] if metas else None


def check_readable(path: Path) -> None:
    if not (path / "data.mdb").is_file():
        raise NotAnIndexError(
            f"{path} holds no sarp index yet (no data.mdb); a reader opens an existing index: "
            "start the writer (sarp serve, or sarp.open without readonly) first"
        )


def readers_full(path: Path, max_readers: int, exc: Exception) -> ReadersFullError:
    return ReadersFullError(
        f"{path}: LMDB's reader table is full ({exc}); every process with the index open "
        f"takes a slot. Close some readers, or have the writer open the index with a larger "
        f"max_readers (now {max_readers}; the first process to open the index sets it)"
    )


def no_room(path: Path) -> str | None:
    """Why a write may have found no room (a nearly full disk, a file-size limit), if so."""
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    if free < LOW_DISK_BYTES:
        return f"the disk holding it has {free:,} bytes free; free some space"
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    data = path / "data.mdb"
    if soft != resource.RLIM_INFINITY and data.exists() and (
            data.stat().st_size + LOW_DISK_BYTES > soft):
        return f"this process may write files of at most {soft:,} bytes (ulimit -f); raise it"
    return None


def take_data_lock(data: Path) -> int:
    """A second writer lock, on ``data.mdb`` itself: a script that deletes a stale-looking
    ``sarp.lock`` must not let two writers in (each would trust its own snapshot)."""
    fd = os.open(data, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise IndexLockedError(
            f"{data.parent} is open for writing in another process (its data.mdb is locked, "
            "even though sarp.lock was not: was sarp.lock deleted?); close the other writer"
        ) from None
    return fd


def take_folder(path: Path, create: bool) -> int:
    """A writer's folder: checked, made when ``create``, and locked (``sarp.lock``);
    returns the lock's descriptor."""
    check_path(path, create)
    try:
        path.mkdir(parents=True, exist_ok=True)
        return take_lock(path / LOCK_FILE)
    except OSError as exc:  # a read-only disk, a file in the way, no permission
        raise ValueError(f"{path}: cannot create or lock the index folder ({exc.strerror}); "
                         "pass a folder this user can write") from None


def take_lock(lock_path: Path) -> int:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if holder == str(os.getpid()):
            raise IndexLockedError(
                f"{lock_path.parent} is already open in this process (pid {holder}); one "
                "open per process: share that Index object (its calls are thread-safe), or "
                "close it first") from None
        raise IndexLockedError(
            f"{lock_path.parent} is open in another process (pid {holder}); "
            "one process owns an index at a time: close it there first"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
