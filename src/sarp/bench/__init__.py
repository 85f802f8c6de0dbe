"""The benchmark: sarp beside its baselines on real traces (``sarp bench``).

``run`` replays requests through each index and measures warm and cold matching,
inserts and recovery; ``ingest`` measures event ingestion (``sarp bench-events``);
``baselines`` holds the indexes people use today; ``traces`` reads the trace files;
``workload`` makes the built-in workload.
"""

from .run import DEFAULT_INDEXES, load_requests, plot, run, table

__all__ = ["DEFAULT_INDEXES", "load_requests", "plot", "run", "table"]
