"""Engine-facing code: what sits between the serving engines and the index.

``events`` (the engines' KV event wire formats, applied to an index), ``media``
(tier names), ``subscriber`` (following engines over ZeroMQ, true to what they
hold), ``serve`` (``sarp serve``), ``router`` (per-instance prefix scores),
``http`` (``sarp serve --http``; its worker processes in ``workers``, or a thread of
serve's own in ``inprocess``) and ``cluster`` (simulated engines for tests and
benchmarks).  Nothing in the index core imports this package.
"""
