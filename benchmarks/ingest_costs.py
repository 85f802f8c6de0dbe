"""Where an event's apply time goes, and the floor the ``blocks`` table sets.

    .venv/bin/python benchmarks/ingest_costs.py [--trace TRACE]   # e.g. ../shared/traces/...

Records the event stream of ``sarp bench-events`` (8 engines, 10,000-block LRU caches)
and reports:

1. what the stream asks of the ``blocks`` table: blocks stored, how many were new,
   how many left with a deleted segment, removes and the runs they walk;
2. the same stream applied to sarp directly (chunks of ``--chunk-events``, by
   default 16,384 as in ``bench-events`` (c)), 5 times each way, interleaved: in C
   (``sarp._native``, what runs), and on the Python reference path with the time inside each part of
   the write path (medians, seconds): claiming new blocks, deleting dead segments'
   entries, writing records, the insert walk, the remove runs; and decoding the
   events, in C and in Python;
3. what a 1-block tail append (a decode step) and a 1-block tail eviction cost
   against the size of the segment they touch, alone and in a batch;
4. LMDB's own cost per key for inserts and deletes in a table the size of the
   stream's, in one write transaction, in random order (py-lmdb ``putmulti`` and
   ``delete``) and in key order through one cursor (a deferred batch's writes), and
   what each makes of (1): the time a write path over this table in that order cannot
   go under.

docs/performance.md ("Event ingestion") quotes a run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import lmdb
import numpy as np

from sarp import native, packing, store_lmdb, writeset
from sarp.bench import ingest
from sarp.bench.run import load_requests
from sarp.serving import events
from sarp.serving.subscriber import MAX_BATCH_OPS

PARTS = {
    "claim new blocks": (store_lmdb.LmdbWriteTxn, "claim_blocks"),
    "delete dead segments": (store_lmdb.LmdbWriteTxn, "delete_segment"),
    "write records": (store_lmdb.LmdbWriteTxn, "put_segment"),
    "insert walk (all of it)": (packing.Packer, "_walk_insert"),
    "remove runs (all of it)": (packing.Packer, "_remove_runs"),
    "flush (all of it)": (writeset.Touched, "flush"),
}


def timed(spent: dict[str, float], label: str, cls, name: str) -> None:
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - started

    setattr(cls, name, wrapper)


def python_decode(payload: bytes):
    """The Python decoder alone (what runs without ``sarp._native``)."""
    batch = events._decode_common(payload)
    return batch if batch is not None else events._decode_full(payload)


def stream_shape(chunks) -> dict[str, int]:
    """Blocks the stream stores (and how many are new), removes, and their runs."""
    held: dict[int, set[str]] = {}
    shape = {"stored": 0, "new": 0, "removed": 0, "removes": 0}
    for chunk in chunks:
        for op in chunk:
            if op[0] == "insert":
                hashes = op[1].tolist()
                shape["stored"] += len(hashes)
                for h in hashes:
                    if h not in held:
                        shape["new"] += 1
                        held[h] = set()
                    held[h].add(op[3])
            elif op[0] == "remove":
                shape["removes"] += 1
                shape["removed"] += op[1].size
                for h in op[1].tolist():
                    holders = held.get(h)
                    if holders is not None:
                        holders.discard(op[2])
                        if not holders:
                            del held[h]
    return shape


def lmdb_costs(table_keys: int, ops: int, rounds: int = 5) -> dict[str, float]:
    """Median µs per key of no-overwrite puts and of deletes, in random order (a claim's
    worth at a time, as an undeferred batch writes them) and in key order through one
    cursor (``put``, and ``set_key`` then ``delete``: a deferred batch does the same
    two steps in one ``pop`` call)."""
    rng = np.random.default_rng(0)
    folder = tempfile.mkdtemp(prefix="sarp-costs-")
    env = lmdb.open(folder, map_size=1 << 32, sync=False,
                    metasync=False, max_dbs=2)
    db = env.open_db(b"blocks")

    def keys(n: int) -> list[bytes]:
        return rng.integers(0, 2**63, n, dtype=np.int64).astype(">u8").view("V8").tolist()

    with env.begin(write=True) as txn:
        txn.cursor(db=db).putmulti([(k, b"\0" * 6) for k in sorted(keys(table_keys))])
    costs: dict[str, list[float]] = {"put": [], "delete": [], "sorted put": [],
                                     "sorted delete": []}
    for _ in range(rounds):
        new = keys(ops)
        items = [(k, b"\0" * 6) for k in new]
        with env.begin(write=True) as txn:
            cursor = txn.cursor(db=db)
            started = time.perf_counter()
            for i in range(0, len(items), 16):  # a claim's worth at a time
                cursor.putmulti(items[i : i + 16], overwrite=False)
            costs["put"].append(1e6 * (time.perf_counter() - started) / ops)
            started = time.perf_counter()
            for k in new:
                txn.delete(k, db=db)
            costs["delete"].append(1e6 * (time.perf_counter() - started) / ops)
            txn.abort()
        new.sort()
        with env.begin(write=True) as txn:
            cursor = txn.cursor(db=db)
            put = cursor.put
            started = time.perf_counter()
            for k in new:
                put(k, b"\0" * 6, True, False)
            costs["sorted put"].append(1e6 * (time.perf_counter() - started) / ops)
            started = time.perf_counter()
            for k in new:
                if cursor.set_key(k):
                    cursor.delete()
            costs["sorted delete"].append(1e6 * (time.perf_counter() - started) / ops)
            txn.abort()
    env.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {kind: statistics.median(v) for kind, v in costs.items()}


def tail_costs(sizes=(16, 256, 1000), rounds: int = 5, steps: int = 500) -> dict:
    """µs per 1-block tail append and per 1-block tail eviction, after a segment of
    ``size`` blocks held by 4 holders: one write transaction each, and ``steps`` of them
    in one batch.  Sizes are interleaved round by round; medians."""
    import sarp

    rng = np.random.default_rng(1)
    costs: dict = {(size, kind): [] for size in sizes
                   for kind in ("append", "remove", "batched append", "batched remove")}
    for _ in range(rounds):
        for size in sizes:
            folder = tempfile.mkdtemp(prefix="sarp-tail-")
            with sarp.open(folder, durability="nosync") as ix:
                chain = rng.integers(1, 2**63, size, dtype=np.int64).view(np.uint64)
                for h in range(4):
                    ix.insert(chain, holder=f"w{h}")
                new = rng.integers(1, 2**63, 2 * steps, dtype=np.int64).view(np.uint64)
                one, batched = new[:steps].tolist(), new[steps:].tolist()
                last = int(chain[-1])
                started = time.perf_counter()
                for h in one:
                    ix.insert([h], parent=last, holder="w0")
                    last = h
                costs[size, "append"].append(time.perf_counter() - started)
                started = time.perf_counter()
                for h in reversed(one):
                    ix.remove([h], holder="w0")
                costs[size, "remove"].append(time.perf_counter() - started)
                last = int(chain[-1])
                started = time.perf_counter()
                with ix.batch() as b:
                    for h in batched:
                        b.insert([h], parent=last, holder="w0")
                        last = h
                costs[size, "batched append"].append(time.perf_counter() - started)
                started = time.perf_counter()
                with ix.batch() as b:
                    for h in reversed(batched):
                        b.remove([h], holder="w0")
                costs[size, "batched remove"].append(time.perf_counter() - started)
            shutil.rmtree(folder, ignore_errors=True)
    return {key: 1e6 * statistics.median(values) / steps for key, values in costs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-events", type=int, default=MAX_BATCH_OPS)
    args = parser.parse_args()
    label, requests = load_requests(args.trace, 1, None, mix_ids=True)
    stream, _ = ingest.record(requests, 8, 10_000)
    chunks = ingest.ops_of(stream, args.chunk_events)
    num_events = sum(len(c) for c in chunks)
    shape = stream_shape(chunks)
    print(f"{label}: {num_events:,} events; {shape['stored']:,} blocks stored, "
          f"{shape['new']:,} of them new; {shape['removes']:,} removes of "
          f"{shape['removed']:,} blocks")

    decode_s = {}
    for way, decode in (("C", events.decode), ("Python", python_decode)):
        started = time.perf_counter()
        for _, payload in stream:
            decode(payload)
        decode_s[way] = time.perf_counter() - started

    spent = dict.fromkeys(PARTS, 0.0)
    for part, (cls, name) in PARTS.items():
        timed(spent, part, cls, name)
    deleted = {"blocks": 0}
    inner_delete = store_lmdb.LmdbWriteTxn.delete_segment

    def counting_delete(self, seg):
        deleted["blocks"] += seg.hashes.size
        return inner_delete(self, seg)

    store_lmdb.LmdbWriteTxn.delete_segment = counting_delete
    totals, parts = {"C": [], "Python": []}, {p: [] for p in PARTS}
    for _ in range(args.rounds):  # interleaved: C, Python, C, Python, ...
        totals["C"].append(ingest.direct("sarp", chunks, tempfile.gettempdir())["seconds"])
        for part in spent:
            spent[part] = 0.0
        deleted["blocks"] = 0
        with native.forced("python"):
            totals["Python"].append(
                ingest.direct("sarp", chunks, tempfile.gettempdir())["seconds"])
        for part, seconds in spent.items():
            parts[part].append(seconds)
    for way in ("C", "Python"):
        total = statistics.median(totals[way])
        print(f"direct apply in {way}: {total:.3f} s median of {args.rounds} "
              f"({num_events / total:,.0f} events/s, {1e6 * total / num_events:.1f} µs/event)")
    for part, values in parts.items():
        print(f"  {part:<26} {statistics.median(values):.3f} s (Python path)")
    for way, seconds in decode_s.items():
        print(f"decoding the events (once) in {way}: {seconds:.3f} s "
              f"({1e6 * seconds / num_events:.1f} µs/event)")

    tails = tail_costs()
    print("tail writes, µs per 1-block operation (segment of N blocks, 4 holders):")
    for size in sorted({size for size, _ in tails}):
        print(f"  N = {size:>5}: " + ", ".join(f"{kind} {tails[size, kind]:.1f}"
                                             for kind in ("append", "remove", "batched append",
                                                          "batched remove")))

    per_key = lmdb_costs(max(shape["new"] // 2, 10_000), 30_000)
    for order, prefix in (("random order", ""), ("key order, one cursor", "sorted ")):
        put_us, delete_us = per_key[prefix + "put"], per_key[prefix + "delete"]
        floor = (shape["new"] * put_us + deleted["blocks"] * delete_us) / 1e6
        print(f"LMDB per key, {order}: {put_us:.2f} µs a put, {delete_us:.2f} µs a delete; "
              f"{shape['new']:,} new blocks put and {deleted['blocks']:,} deleted with "
              f"their segments: {floor:.3f} s, a ceiling of {num_events / floor:,.0f} "
              "events/s for a write path over this table that writes in this order")


if __name__ == "__main__":
    main()
