"""What an index counts (``Index.stats``): its writes, matches and recoveries.

>>> c = Counters(); c.matched([]); c.matches
0
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .errors import CorruptRecordError

log = logging.getLogger("sarp")


@dataclass(slots=True)
class Counters:
    """Every counter of one index, all from 0 at its open."""

    inserts: int = 0
    inserted_blocks: int = 0
    matches: int = 0
    matched_blocks: int = 0
    storage_reads: int = 0
    removes: int = 0
    removed_blocks: int = 0
    remove_missing: int = 0
    clears: int = 0
    snapshots: int = 0
    changes_since_snapshot: int = 0
    corrupt_records: int = 0  # damaged segment records a match stopped at
    batches: int = 0  # apply_batch / batch() commits
    batched_ops: int = 0  # operations they carried
    snapshot_reloads: int = 0  # a reader found the log trimmed past it and reloaded
    reader_rebuilds: int = 0  # ... and had no usable snapshot: rebuilt in memory
    log_holes: int = 0  # a reader found entries missing from the log, and reloaded
    index_reloads: int = 0  # a reader found the index created anew, and reloaded

    def batch(self, plan, ops: int) -> None:
        """Count one batch commit (its :class:`sarp.writeset.Plan`) of ``ops`` operations
        (none: a state's own write)."""
        if not ops:
            return
        self.batches += 1
        self.batched_ops += ops
        self.inserted_blocks += plan.new_blocks
        self.removed_blocks += plan.removed_blocks

    def matched(self, answers: list) -> None:
        """Count these answers (:class:`sarp.answer.Match`)."""
        for m in answers:
            self.matches += 1
            self.matched_blocks += m.num_blocks
            self.storage_reads += m.storage_reads

    def match_stopped(self, exc: CorruptRecordError) -> None:
        """A match stopped at a damaged record: the prefix verified so far is still
        exact, so it answers that rather than fail the request (``sarp verify`` names
        the damage)."""
        self.corrupt_records += 1
        log.error("sarp: match stops at %s", exc)
