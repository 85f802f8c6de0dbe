"""One working-set pass against simulating an LRU cache at N capacities one by one.

    .venv/bin/python benchmarks/workingset_speed.py --trace PATH [--split K]
        [--limit-requests N] [--capacities 20] [--sample-rate R] [--sample-size N] [--mix-ids]

Both run in this process, one after the other; the simulation is the plain
OrderedDict LRU of the issue (prefix hits, then touch last block first), and every
simulated hit count is checked against the curve.  With ``--sample-rate`` or
``--sample-size`` it also reports the sampled curve's largest error at any
capacity and the sampler's memory.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from sarp.bench.traces import read_requests
from sarp.hashing import splitmix64
from sarp.workingset import WorkingSet, analyze, simulate_lru


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--limit-requests", type=int)
    parser.add_argument("--capacities", type=int, default=20)
    parser.add_argument("--sample-rate", type=float)
    parser.add_argument("--sample-size", type=int)
    parser.add_argument("--mix-ids", action="store_true",
                        help="map trace ids to well-spread 64-bit values first, like the "
                             "hashes engines send (the dense-id mapping then has to sort)")
    args = parser.parse_args()
    requests = [r.hashes for r in read_requests(args.trace, split=args.split,
                                                limit=args.limit_requests)]
    if args.mix_ids:
        requests = [splitmix64(r) for r in requests]
    accesses = sum(r.size for r in requests)
    t0 = time.perf_counter()
    curve = analyze(requests)
    one_pass = time.perf_counter() - t0
    print(f"{args.trace} split {args.split}{' (ids mixed)' if args.mix_ids else ''}: "
          f"{len(requests)} requests, {accesses} accesses")
    print(f"one pass: {one_pass:.2f} s, unbounded hit rate {curve.unbounded_hit_rate:.4f}")

    if args.sample_rate or args.sample_size:
        ws = WorkingSet(sample_rate=args.sample_rate or 1.0, sample_size=args.sample_size)
        t0 = time.perf_counter()
        for chain in requests:
            ws.observe(chain)
        sampled = ws.curve()
        sampled_s = time.perf_counter() - t0
        size = max(curve.needed.size, sampled.needed.size)
        exact_cum = np.cumsum(np.pad(curve.needed, (0, size - curve.needed.size))) / accesses
        approx_cum = np.cumsum(np.pad(sampled.needed, (0, size - sampled.needed.size)))
        error = float(np.abs(exact_cum - approx_cum / sampled.accesses).max())
        print(f"sampled (final rate {ws.sample_rate:.4f}, {len(ws._last)} blocks tracked, "
              f"{ws.nbytes() / 1e6:.2f} MB): {sampled_s:.2f} s, "
              f"largest error at any capacity {error:.4f}")

    points = np.array([p["capacity_blocks"] for p in curve.points()])
    caps = sorted({int(points[int(i)]) for i in np.linspace(0, points.size - 1,
                                                            args.capacities)})
    lists = [r.tolist() for r in requests]
    t0 = time.perf_counter()
    for c in caps:
        hits = simulate_lru(lists, c)
        assert round(curve.hit_rate(c) * accesses) == hits, (c, hits)
    simulated = time.perf_counter() - t0
    print(f"simulating {len(caps)} capacities: {simulated:.2f} s "
          f"({simulated / len(caps):.2f} s each); every one equals the curve")
    print(f"one pass is {simulated / one_pass:.1f}x faster than {len(caps)} simulations")


if __name__ == "__main__":
    main()
