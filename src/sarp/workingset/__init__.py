"""The working-set analyzer: LRU prefix-cache hit rate at every capacity, in one pass.

``analyzer`` computes the curve (exact, or sampled online with SHARDS); ``cli`` is
``sarp workingset``.
"""

from .analyzer import HitCurve, WorkingSet, analyze, simulate_lru

__all__ = ["HitCurve", "WorkingSet", "analyze", "simulate_lru"]
