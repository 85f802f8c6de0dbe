"""The backlog drain of ``sarp bench-events`` (a), for two source trees, interleaved.

Each pass is a fresh process that imports sarp from one tree (``PYTHONPATH``),
records the same engine stream and drains it through that tree's subscriber; the
trees take turns (A, B, A, B, ...), and the medians and ranges are printed with
their ratio.  For checking that a change to the ingest path costs nothing::

    git worktree add /tmp/old HEAD~1 && cp src/sarp/_native*.so /tmp/old/src/sarp/
    .venv/bin/python benchmarks/backlog_ab.py --a /tmp/old/src --b src \\
        --trace ../shared/traces/mooncake_conversation.jsonl --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, tempfile
from sarp.bench.ingest import backlog, record
from sarp.bench.run import load_requests
trace, durability = sys.argv[1] or None, sys.argv[2]
_, requests = load_requests(trace, 1, None, mix_ids=True)
stream, caches = record(requests, 8, 10_000)
with tempfile.TemporaryDirectory() as work:
    out = backlog(stream, 8, caches, durability, work)
print(json.dumps(out))
"""


def one(tree: str, trace: str | None, durability: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, trace or "", durability], env=env,
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="source tree A (its src/)")
    parser.add_argument("--b", required=True, help="source tree B")
    parser.add_argument("--trace", default=None, help="default: the built-in workload")
    parser.add_argument("--durability", default="nosync", choices=["sync", "nosync"])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory():
        for i in range(args.repeat):
            for name in ("a", "b"):
                got = one(getattr(args, name), args.trace, args.durability)
                if not got["index_equals_caches"]:
                    raise SystemExit(f"tree {name}: the index differs from the caches")
                rates[name].append(got["events_per_s"])
                print(f"pass {i + 1} {name}: {got['events_per_s']:,.0f} events/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    for name in ("a", "b"):
        print(f"{name}: median {med[name]:,.0f} events/s "
              f"({min(rates[name]):,.0f}-{max(rates[name]):,.0f})")
    print(f"b / a = {med['b'] / med['a']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
