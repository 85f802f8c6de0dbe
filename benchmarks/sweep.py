"""Sweep sarp's packing tunables on one workload; print one row per setting.

    .venv/bin/python benchmarks/sweep.py [--trace PATH] [--split K] [--limit-requests N]
        [--segment-blocks 16,64,256,1024] [--split-tail 0,4,256]

Each setting replays the requests (match, then insert the unmatched blocks), then
times three warm passes of matches over every second request and reports the median
time per match, the storage reads per match, directory entries and disk use.
``--split-tail`` sets how short a dead-end tail must be to be moved out of a
segment when a chain branches just before its end (0 = never).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import sarp
import sarp.general
import sarp.packing
from sarp.bench import load_requests


def measure(requests, segment_blocks: int) -> dict:
    with tempfile.TemporaryDirectory() as folder, sarp.open(
        folder, durability="nosync", segment_blocks=segment_blocks
    ) as index:
        t0 = time.perf_counter()
        for r in requests:
            n = index.match(r.hashes).num_blocks
            if n < r.hashes.size:
                index.insert(r.hashes[n:], parent=int(r.hashes[n - 1]) if n else None,
                             holder="engine-0")
        replay_s = time.perf_counter() - t0
        sample = requests[::2]
        passes, reads = [], 0
        for _ in range(3):
            t = time.perf_counter()
            for r in sample:
                reads += index.match(r.hashes).storage_reads
            passes.append((time.perf_counter() - t) / len(sample))
        stats = index.stats()
        return {
            "match_us": 1e6 * statistics.median(passes),
            "reads_per_match": reads / (3 * len(sample)),
            "replay_s": replay_s,
            "directory_entries": stats["directory_entries"],
            "disk_mb": stats["disk_bytes"] / 1e6,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace")
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--limit-requests", type=int)
    parser.add_argument("--segment-blocks", default="16,64,256,1024")
    parser.add_argument("--split-tail", default=str(sarp.general.SPLIT_TAIL_BLOCKS))
    args = parser.parse_args()
    label, requests = load_requests(args.trace, args.split, args.limit_requests)
    print(f"{label}: {len(requests)} requests")
    print(f"{'S':>6} {'split tail':>10} {'match us':>9} {'reads':>6} {'replay s':>9} "
          f"{'entries':>8} {'disk MB':>8}")
    for tail in (int(x) for x in args.split_tail.split(",")):
        sarp.general.SPLIT_TAIL_BLOCKS = tail
        for s in (int(x) for x in args.segment_blocks.split(",")):
            r = measure(requests, s)
            print(f"{s:>6} {tail:>10} {r['match_us']:>9.1f} {r['reads_per_match']:>6.2f} "
                  f"{r['replay_s']:>9.2f} {r['directory_entries']:>8} {r['disk_mb']:>8.1f}")


if __name__ == "__main__":
    main()
