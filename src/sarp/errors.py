"""The exceptions sarp raises.

Every error sarp raises on purpose derives from :class:`SarpError`, except bad
arguments, which get the builtin :class:`ValueError` / :class:`TypeError` with
the offending value and the fix in the message (some errors are both: a
:class:`ParentNotFoundError` is a ``SarpError`` and a ``ValueError``).
"""

from __future__ import annotations


class SarpError(Exception):
    """Base class of every error specific to sarp."""


class NotAnIndexError(SarpError):
    """The path exists but does not hold a sarp index."""


class FormatVersionError(SarpError):
    """The index on disk was written by a newer sarp with a newer format."""


class IndexLockedError(SarpError):
    """Another process has the index open for writing."""


class IndexClosedError(SarpError):
    """The index was used after ``close()``."""


class StoreError(SarpError):
    """LMDB refused an operation (I/O error, damaged environment)."""


class DamagedIndexError(StoreError):
    """The LMDB file is truncated or not an LMDB file: opening it would crash the process."""


class ReadersFullError(StoreError):
    """More processes have the index open than LMDB's reader table holds (``max_readers``)."""


class ReadOnlyIndexError(SarpError):
    """A write (``insert``, ``remove``, ``clear``, ``snapshot``) on a ``readonly=True`` index."""


class LeaseLostError(SarpError):
    """A Valkey-backed writer lost its lease (another writer took over, or it was paused
    past the lease): its writes are refused; reopen to write again."""


class StoreFullError(StoreError):
    """The LMDB map could not grow to hold a write (disk full or map size limit)."""


class CorruptRecordError(SarpError):
    """A stored record failed its checksum or does not parse."""


class ParentNotFoundError(SarpError, ValueError):
    """``insert(parent=...)`` named a block that no holder has in the index."""


class ChainConflictError(SarpError, ValueError):
    """A hash is already in the index at another position or after another parent."""


class TraceError(ValueError):
    """A trace that cannot be read as one: the message names the file, the line and
    what is wrong (:mod:`sarp.bench.traces`; here so that the command line can catch
    it without importing the benchmarks)."""
