"""lmdb's one door: an index folder's environment opened as sarp opens it, and the
names of lmdb's errors and types that sarp meets.

``store_lmdb`` (the LMDB backend) and ``serving.early`` (serve's first answers, which
must start before numpy is imported) open environments through :func:`open_env`;
nothing else imports lmdb.  Cost: the import of lmdb (a few ms), nothing else.
"""

from __future__ import annotations

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
