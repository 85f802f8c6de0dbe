"""The benchmark: sarp beside its baselines on real traces (``sarp bench``).

``run`` replays requests through each index and measures warm and cold matching,
inserts and recovery; ``baselines`` holds the indexes people use today; ``traces``
reads the trace files; ``workload`` makes the built-in workload.
"""

from .run import load_requests, plot, run, table

__all__ = ["load_requests", "plot", "run", "table"]
