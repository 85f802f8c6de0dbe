"""The one door to sarp's C code: loads ``sarp._native``, checks its ABI, honours
``SARP_PURE_PYTHON``, and lets tests choose a path and see which one ran.

Every C call has a Python reference beside the C file that mirrors it (``verify.c``
beside ``verify.py``, ``packing.c``, ``serving/events.c``, ``serving/http.c``,
``serving/rfc.c``, ``serving/wire.c`` (whose reference is ``wire.Connection``),
``directory.c``, ``segment.c``).  A
caller reads :data:`C` at call time, never at import, so that :func:`forced` reaches
it::

    c = native.C
    if c is not None:
        return c.walk(...)
    native.ran_python("walk")
    ...                      # the reference

Environment: ``SARP_PURE_PYTHON=1`` runs the Python path everywhere (``0`` or empty
does not); ``SARP_REQUIRE_NATIVE=1`` (set by ``.ci/run``) makes a missing or refused
extension an ``ImportError`` instead of a silent fall back to Python.

>>> from sarp import native
>>> with native.forced("python"), native.Tally() as t:
...     _ = native.C
>>> native.C is None or native.AVAILABLE, t.c("walk"), t.python("walk")
(True, 0, 0)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

ABI = 35  # native.c's ABI_VERSION
# in the order of _native.calls(); "conn" counts requests a C connection answered, and
# its Python runs the connections the reference serves (taken, or handed over);
# "lmdb_pack" counts pack_batch calls on liblmdb's own calls (and its Python the ones
# through py-lmdb's methods: lmdb_env.raw_handle said no); "lmdb_read" counts rfc_query
# calls that read in a transaction of liblmdb's own (lmdb_env.raw_reads)
PATHS = ("examine", "walk", "pack_batch", "decode_batch", "u64_array", "token_keys",
         "resolve_aliases", "block_table", "decode_into", "find", "read_match", "rfc_answer",
         "rows_result", "plain_result", "query_fields", "conn", "rfc_query", "heads", "xxh3_64",
         "alias_table", "take_line", "lmdb_pack", "lmdb_read")
_TRUE = ("1", "true", "yes", "on")


def _load() -> tuple[ModuleType | None, str]:
    """The extension and "", or None and why not."""
    try:
        from . import _native
    except ImportError as exc:  # no C compiler at install, or a build for another Python
        return None, f"is not built ({exc})"
    abi = getattr(_native, "ABI_VERSION", None)
    if abi != ABI:
        return None, f"speaks ABI {abi}, not {ABI} (a stale build: reinstall sarp)"
    return _native, ""


_MODULE, WHY = _load()
AVAILABLE = _MODULE is not None  # built, and speaks this ABI
PURE_PYTHON = os.environ.get("SARP_PURE_PYTHON", "").strip().lower() in _TRUE
if os.environ.get("SARP_REQUIRE_NATIVE", "").strip().lower() in _TRUE and not PURE_PYTHON \
        and not AVAILABLE:
    raise ImportError(f"SARP_REQUIRE_NATIVE=1, but sarp._native {WHY}; install a C compiler "
                      "(or run `make`, which falls back to zig cc) and reinstall sarp")
# What callers use: the extension, or None for the Python path.
C: ModuleType | None = None if PURE_PYTHON else _MODULE
_python_calls = dict.fromkeys(PATHS, 0)


def ran_python(path: str) -> None:
    """Count one run of ``path``'s Python reference (for :func:`calls`).  Cost: a dict
    update, on the Python path only."""
    _python_calls[path] += 1


def calls() -> dict[str, tuple[int, int]]:
    """``{path: (calls in C, runs of the Python reference)}`` since this process began.

    >>> sorted(calls()) == sorted(PATHS)
    True
    """
    in_c = _MODULE.calls() if _MODULE is not None else (0,) * len(PATHS)
    return {path: (in_c[i], _python_calls[path]) for i, path in enumerate(PATHS)}


@contextmanager
def forced(path: str) -> Iterator[None]:
    """Run the block on the ``"c"`` or the ``"python"`` path (for tests and benchmarks;
    not thread-safe).  ``"c"`` where the extension is unavailable is a RuntimeError."""
    global C
    if path not in ("c", "python"):
        raise ValueError(f"path={path!r}; pass 'c' or 'python'")
    if path == "c" and _MODULE is None:
        raise RuntimeError(f"sarp._native {WHY}: the C path cannot be forced")
    saved, C = C, (_MODULE if path == "c" else None)
    try:
        yield
    finally:
        C = saved


class Tally:
    """Which paths ran inside a ``with`` block: ``t.c("walk")``, ``t.python("walk")``."""

    def __enter__(self) -> Tally:
        self._before = calls()
        self._after: dict[str, tuple[int, int]] | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        self._after = calls()

    def _diff(self, path: str, which: int) -> int:
        after = self._after if self._after is not None else calls()
        return after[path][which] - self._before[path][which]

    def c(self, path: str) -> int:
        """Calls into C of ``path`` (so far, or in the block once it ended)."""
        return self._diff(path, 0)

    def python(self, path: str) -> int:
        """Runs of ``path``'s Python reference."""
        return self._diff(path, 1)
