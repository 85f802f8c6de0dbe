"""Reading request traces in the Mooncake format: one JSON object per line.

Each line has ``hash_ids``, the request's chain of block ids (one per block of
tokens); extra fields (``timestamp``, ``session_id``, ``agent``...) are ignored
except ``session_id``, kept when present.  ``.jsonl`` and ``.jsonl.gz`` both work.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TraceError


@dataclass(frozen=True, slots=True)
class Request:
    hashes: np.ndarray
    session_id: str | None = None


def split_blocks(ids: np.ndarray, k: int) -> np.ndarray:
    """Turn each block into ``k`` sub-blocks with derived chained ids (``id * k + j``).

    Ids stay chained: a sub-block id names its block's prefix plus ``j`` sub-blocks.

    >>> split_blocks(np.array([3, 7], np.uint64), 2).tolist()
    [6, 7, 14, 15]
    """
    if k == 1:
        return ids
    if ids.size and int(ids.max()) >= (1 << 64) // k:
        raise TraceError(f"block id {int(ids.max())} is too large to split {k} ways in 64 bits")
    return (ids[:, None] * np.uint64(k) + np.arange(k, dtype=np.uint64)).ravel()


def read_requests(
    path: str | os.PathLike, *, split: int = 1, limit: int | None = None
) -> Iterator[Request]:
    """Yield the trace's requests in file order.

    Cost: O(file size); one JSON parse per line.
    """
    if isinstance(split, bool) or not isinstance(split, int) or split < 1:
        raise ValueError(f"split={split!r}; pass an int >= 1 (4 turns 64-token blocks into 16)")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        yield from _read(path, opener, split, limit)
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # not gzip, not text, unreadable
        raise TraceError(f"{path}: cannot be read as a mooncake-format trace ({exc}); pass "
                         "a .jsonl (or .jsonl.gz) file of {\"hash_ids\": [...]} lines") from exc


def _read(path: Path, opener, split: int, limit: int | None) -> Iterator[Request]:
    count = 0
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = np.asarray(row["hash_ids"], dtype=np.uint64)
            except (ValueError, KeyError, TypeError, OverflowError) as exc:
                raise TraceError(
                    f"{path}:{line_no}: not a trace line with a 'hash_ids' list of ints ({exc})"
                ) from exc
            if ids.size == 0:
                continue
            count += 1
            yield Request(split_blocks(ids, split), row.get("session_id"))
