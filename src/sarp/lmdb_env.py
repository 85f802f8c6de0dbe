"""lmdb's one door: an index folder's environment opened as sarp opens it, the names of
lmdb's errors and types that sarp meets, and py-lmdb's write transactions handed to C.

``store_lmdb`` (the LMDB backend) and ``serving.early`` (serve's first answers, which
must start before numpy is imported) open environments through :func:`open_env`;
nothing else imports lmdb.  Cost: the import of lmdb (a few ms), nothing else.

The packer (``packing.c``) reads and writes a commit's ``blocks`` and ``segments``
through liblmdb's own calls when :func:`raw_handle` gives it the transaction: py-lmdb
bundles its LMDB engines in its extension and exports their C API (``mdb09_*`` for
0.9, ``mdb10_*`` for 1.0), and a transaction object holds its ``MDB_txn``.  Where
that is is py-lmdb's own layout, not its API, so it is taken only when everything
around it is where it must be (the transaction's environment and parent, its engine
the environment's, ``mdb_txn_id`` and ``mdb_txn_env`` of it agreeing with py-lmdb),
and the calls are used only after they have read and written as py-lmdb does, once
per process (:func:`_check`); otherwise, or with another lmdb build, the packer
calls py-lmdb's methods as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import tempfile
import weakref

import lmdb

Environment = lmdb.Environment
Transaction = lmdb.Transaction
Error = lmdb.Error
MapFullError = lmdb.MapFullError
MapResizedError = lmdb.MapResizedError
NotFoundError = lmdb.NotFoundError
ReadersFullError = lmdb.ReadersFullError
MAX_TABLES = 8  # named tables an environment may hold (store.TABLES and room to spare)


def open_env(path: str, *, map_size: int = 1 << 36, max_readers: int = 512,
             durability: str = "sync", readonly: bool = False,
             lock: bool = True) -> lmdb.Environment:
    """An index folder's environment: readahead off (a match reads a page or two, and
    readahead would fill the page cache with neighbours), syncs as ``durability``
    says, created only by a writer.  ``lock=False`` only for a folder no writer has
    open (repair, verify of a copy).

    >>> import tempfile
    >>> env = open_env(tempfile.mkdtemp())
    >>> env.flags()["readonly"], env.close()
    (False, None)
    """
    return lmdb.open(path, map_size=map_size, max_dbs=MAX_TABLES, max_readers=max_readers,
                     sync=durability == "sync", metasync=durability == "sync",
                     readahead=False, lock=lock, readonly=readonly, create=not readonly)


# py-lmdb 3's objects as its cpython.c lays them out on 64-bit builds: a Transaction's
# environment, parent, engine and MDB_txn; an Environment's MDB_env and engine
_TXN_ENV, _TXN_PARENT, _TXN_ENGINE, _TXN_HANDLE = 64, 72, 80, 88
_ENV_HANDLE, _ENV_ENGINE = 64, 72
_ENGINES = {(0, 9): (0, "mdb09_"), (1, 0): (1, "mdb10_")}  # (major, minor): number, prefix
_CALLS = ("get", "put", "del", "cursor_open", "cursor_close", "cursor_get", "cursor_put",
          "cursor_del", "txn_id", "txn_env", "dbi_open", "txn_begin",
          "txn_abort", "set_compare")  # lmdb_bind's order
KEY_EXISTS = -30799  # MDB_KEYEXIST
_ERRORS = {-30799: lmdb.KeyExistsError, -30798: lmdb.NotFoundError,
           -30797: lmdb.PageNotFoundError, -30796: lmdb.CorruptedError,
           -30795: lmdb.PanicError, -30792: lmdb.MapFullError, -30788: lmdb.TxnFullError,
           -30787: lmdb.CursorFullError, -30786: lmdb.PageFullError,
           -30782: lmdb.BadTxnError, -30781: lmdb.BadValsizeError, -30780: lmdb.BadDbiError,
           errno.EACCES: lmdb.ReadonlyError, errno.EINVAL: lmdb.InvalidParameterError,
           errno.ENOMEM: lmdb.MemoryError, errno.ENOSPC: lmdb.DiskError}
_raw: dict[tuple[int, int], int] | None = None  # engines checked: (major, minor) -> number
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # env -> RAW_TABLES' dbi
RAW_TABLES = (b"blocks", b"segments", b"meta", b"log")  # the tables C writes, in its order
log = logging.getLogger("sarp")


def raise_for(rc: int) -> None:
    """Raise the error class py-lmdb raises for LMDB's return code ``rc`` (for C's calls).

    >>> raise_for(-30792)
    Traceback (most recent call last):
      ...
    lmdb.MapFullError: liblmdb returned -30792 to sarp's packer
    """
    raise _ERRORS.get(rc, lmdb.Error)(f"liblmdb returned {rc} to sarp's packer")


def raw_handle(txn: lmdb.Transaction, env: lmdb.Environment,
               parent: lmdb.Transaction | None = None) -> tuple[int, int] | None:
    """``(engine, MDB_txn address)`` of py-lmdb's write transaction ``txn`` on ``env``
    (a nested one: ``parent`` its parent), for ``sarp._native``'s liblmdb calls; None
    when they are not to be used: no extension, another lmdb build, a check failed,
    or the transaction is not where py-lmdb 3 keeps it.  The transaction stays
    py-lmdb's: C uses the address only while ``txn`` is open.

    Cost: the first call checks the calls (a temporary environment, about a
    millisecond); then a few reads of the objects and one C call.

    >>> import tempfile
    >>> env, other = open_env(tempfile.mkdtemp()), open_env(tempfile.mkdtemp())
    >>> with env.begin(write=True) as txn:
    ...     at, elsewhere = raw_handle(txn, env), raw_handle(txn, other)
    >>> elsewhere, at is None or at[1] > 0, env.close(), other.close()
    (None, True, None, None)
    """
    if _raw is None:
        _check()
    return _handle(txn, env, parent, _raw) if _raw else None


def raw_tables(txn: lmdb.Transaction, env: lmdb.Environment,
               parent: lmdb.Transaction | None = None) -> tuple | None:
    """What ``pack_batch`` takes to write ``txn`` through liblmdb's calls: its
    :func:`raw_handle`, the handles of :data:`RAW_TABLES` (opened by name once per
    environment; the store opened them) and :func:`raise_for`; or None.

    Cost: :func:`raw_handle`'s.
    """
    at = raw_handle(txn, env, parent)
    if at is None:
        return None
    dbis = _tables.get(env)
    if dbis is None:
        from . import native

        opened = [native.C.lmdb_dbi(*at, name) for name in RAW_TABLES]
        if any(rc for rc, _ in opened):
            return None
        dbis = _tables[env] = tuple(dbi for _, dbi in opened)
    return (*at, *dbis, raise_for)


def raw_reads(env: lmdb.Environment, tables: tuple[bytes, ...]) -> tuple | None:
    """``(engine, MDB_env address, *the tables' handles)`` for read-only transactions
    of C's own on ``env`` (``rfc_query``'s), or None as :func:`raw_handle` says.  The
    address is taken only where a py-lmdb transaction of ``env`` confirms it.

    Cost: one read transaction and a C call per table, once (the caller keeps it).

    >>> import tempfile
    >>> env = open_env(tempfile.mkdtemp())
    >>> table = env.open_db(b"t")
    >>> reads = raw_reads(env, (b"t",))
    >>> reads is None or len(reads) == 3, env.close()
    (True, None)
    """
    if _raw is None:
        _check()
    return raw_reads_of(env, _raw, tables) if _raw else None


def raw_reads_of(env: lmdb.Environment, engines: dict[tuple[int, int], int],
                 tables: tuple[bytes, ...]) -> tuple | None:
    """:func:`raw_reads` with ``engines`` (the check's, or those it kept)."""
    from . import native

    with env.begin() as txn:
        at = _handle(txn, env, None, engines)
    if at is None:
        return None
    where = (at[0], _word(env, _ENV_HANDLE))
    opened = [native.C.lmdb_read_dbi(*where, name) for name in tables]
    if any(rc for rc, _ in opened):
        return None
    return (*where, *(dbi for _, dbi in opened))


def _word(obj: object, offset: int) -> int:
    return ctypes.c_void_p.from_address(id(obj) + offset).value or 0


def _handle(txn, env, parent, engines: dict[tuple[int, int], int]) -> tuple[int, int] | None:
    from . import native

    if (native.C is None  # (forced off: sarp.native.forced("python"))
            or type(txn).__basicsize__ < _TXN_HANDLE + 8
            or type(env).__basicsize__ < _ENV_ENGINE + 8
            or _word(txn, _TXN_ENV) != id(env)
            or _word(txn, _TXN_PARENT) != (0 if parent is None else id(parent))):
        return None
    api = _word(txn, _TXN_ENGINE)
    handle = _word(txn, _TXN_HANDLE)
    if not api or api != _word(env, _ENV_ENGINE) or not handle:
        return None
    engine = engines.get((ctypes.c_int.from_address(api).value,
                          ctypes.c_int.from_address(api + 4).value))
    if engine is None:
        return None
    txn_id, env_handle = native.C.lmdb_txn(engine, handle)
    if txn_id != txn.id() or env_handle != _word(env, _ENV_HANDLE):
        return None
    return engine, handle


def _check() -> None:
    """Bind each engine py-lmdb exports and keep those whose calls read and write as
    py-lmdb's methods do on a temporary environment (once per process; any error
    keeps none, and the packer calls py-lmdb's methods)."""
    global _raw
    found: dict[tuple[int, int], int] = {}
    try:
        from . import native

        extension = getattr(lmdb, "cpython", None)  # (None: py-lmdb's cffi build)
        if native.C is not None and extension is not None:
            lib = ctypes.CDLL(extension.__file__)  # the extension loaded: its symbols
            for version, (number, prefix) in _ENGINES.items():
                try:
                    at = tuple(ctypes.cast(getattr(lib, prefix + c), ctypes.c_void_p).value
                               for c in _CALLS)
                except AttributeError:
                    continue  # this build has not that engine
                native.C.lmdb_bind(number, at)
                if _agrees(version[0], {version: number}):
                    found[version] = number
    except Exception:  # whatever it is, py-lmdb's methods stay the way
        log.warning("sarp: liblmdb's calls not used (the check failed); the packer "
                    "calls py-lmdb's methods", exc_info=True)
        found = {}
    _raw = found


def _agrees(major: int, engines: dict[tuple[int, int], int]) -> bool:
    """The calls of ``engines``' one engine against py-lmdb's methods on a temporary
    environment of it: a get, a put and a refused put, in a transaction and in one
    nested in it, each seen by the other side."""
    from . import native

    c = native.C
    with tempfile.TemporaryDirectory(prefix="sarp-lmdb-check-") as tmp:
        env = lmdb.open(tmp, map_size=1 << 20, max_dbs=2, sync=False, metasync=False,
                        lib_version=major)
        with contextlib.closing(env):
            table = env.open_db(b"t")
            with env.begin(write=True) as txn:
                txn.put(b"k" * 8, b"py", db=table)
                at = _handle(txn, env, None, engines)
                if at is None:
                    return False
                rc, dbi = c.lmdb_dbi(*at, b"t")
                ok = (rc == 0 and c.lmdb_get(*at, dbi, b"k" * 8) == (0, b"py")
                      and c.lmdb_get(*at, dbi, b"z" * 8)[1] is None
                      and c.lmdb_put(*at, dbi, b"c" * 8, b"c", False) == 0
                      and c.lmdb_put(*at, dbi, b"c" * 8, b"x", False) == KEY_EXISTS
                      and txn.get(b"c" * 8, db=table) == b"c")
                child = env.begin(write=True, parent=txn)
                inner = _handle(child, env, txn, engines)
                ok = ok and inner is not None and c.lmdb_put(*inner, dbi, b"n" * 8, b"n",
                                                             True) == 0
                child.commit()
                ok = ok and txn.get(b"n" * 8, db=table) == b"n"
            with env.begin() as txn:
                ok = ok and [txn.get(k * 8, db=table) for k in (b"k", b"c", b"n")] == [
                    b"py", b"c", b"n"]
            reads = ok and raw_reads_of(env, engines, (b"t",))
            return bool(reads) and c.lmdb_read_get(*reads[:2], reads[2], b"c" * 8) == (0, b"c")
