"""The sharded index on a real 3-node Valkey cluster on loopback (issue 28): ingest
with 1, 2 and 3 shard writers (one process each, the engines split between them), and
match throughput per request of the sharded index (3 shards, one per node) against
one namespace fed the same stream, passes interleaved, medians (min-max); and the
floor of that ratio on this machine: bare round trips to the three nodes at once
against one node's (:func:`round_trip_floor`), and the matches' own reads sent with no
client work around them (:func:`read_floor`), each pass beside the matches' passes.

    .venv/bin/python benchmarks/valkey_shards.py --repeat 3 \\
        --json bench-results/valkey-shards-builtin.json
    .venv/bin/python benchmarks/valkey_shards.py --repeat 3 \\
        --trace ../shared/traces/mooncake_conversation.jsonl \\
        --json bench-results/valkey-shards-mooncake.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
import uuid
from pathlib import Path

import numpy as np

import sarp
from sarp.bench import ingest
from sarp.bench.run import load_requests
from sarp.bench.valkey_server import ValkeyCluster
from sarp.valkey_shards import drop_namespace

ENGINES = 8


def holder_of(op: tuple) -> str:
    return op[3] if op[0] == "insert" else op[2] if op[0] == "remove" else op[1]


def shard_of(holder: str, shards: int) -> int:
    return int(holder[1:].split("#")[0]) % shards  # engine e<i>#0 -> shard i mod k


def _writer(url: str, shard: str | None, chunks, start, done) -> None:
    from sarp.serving.serve import collector_tuned

    with sarp.open(url, shard=shard, durability="nosync") as index, collector_tuned():
        start.wait()
        began = time.perf_counter()
        for chunk in chunks:
            index.apply_decoded(chunk)
        done.put((began, time.perf_counter()))


def ingest_run(url: str, chunks, shards: int) -> float:
    """Events/s with ``shards`` writers at once, each applying its engines' events."""
    ctx = mp.get_context("spawn")
    start, done = ctx.Event(), ctx.Queue()
    parts = [[[op for op in c if shard_of(holder_of(op), shards) == k] for c in chunks]
             for k in range(shards)]
    procs = [ctx.Process(target=_writer, args=(url, f"s{k}", parts[k], start, done))
             for k in range(shards)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # every writer open (its lease taken) before the start
    start.set()
    spans = [done.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return sum(len(c) for c in chunks) / (max(e for _, e in spans) - min(b for b, _ in spans))


def match_rate(index, queries) -> float:
    started = time.perf_counter()
    for q in queries:
        index.match(q)
    return len(queries) / (time.perf_counter() - started)


def round_trip_floor(cluster, repeat: int, count: int = 3000) -> dict:
    """Bare ``PING`` round trips, one node's against three nodes' sent at once (the
    sharded match's pattern with no work around it), interleaved: the best ratio a
    client on this machine can reach, whatever its code."""
    import valkey

    conns = [valkey.Connection(port=s.port) for s in cluster.servers]
    ping = b"*1\r\n$4\r\nPING\r\n"

    def rate(nodes) -> float:
        started = time.perf_counter()
        for _ in range(count):
            for c in nodes:
                c.send_packed_command([ping])
            for c in nodes:
                c.read_response()
        return count / (time.perf_counter() - started)

    runs: dict[str, list[float]] = {"one node": [], "3 nodes": []}
    for _ in range(repeat):
        runs["one node"].append(rate(conns[:1]))
        runs["3 nodes"].append(rate(conns))
    for c in conns:
        c.disconnect()
    one, three = (statistics.median(r) for r in runs.values())
    return {"round_trips_per_s": runs, "three_to_one": three / one}


def read_floor(cluster, locations: list[str], queries) -> float:
    """The reads a match of each query makes on these namespaces (the ``READ`` of each
    one's predicted records, as ``sarp.valkey_read`` packs it), packed beforehand and
    sent on a connection of their own to each namespace's node, all of a query's at
    once and then read (raw sockets, libvalkey's parser): the match's wait with no
    client work around it.  Queries per second."""
    import socket

    import libvalkey
    from valkey.cluster import ValkeyCluster as Client

    from sarp.store import parse_url
    from sarp.valkey_scripts import ReadAhead

    client = Client(host="127.0.0.1", port=cluster.servers[0].port)
    links, commands = [], []
    for location in locations:
        ns = parse_url(location)["namespace"]
        meta, seg = (f"sarp:{{{ns}}}:{t}".encode() for t in ("meta", "seg"))
        node = client.get_node_from_key(meta)
        links.append(socket.create_connection((node.host, node.port)))
        links[-1].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with sarp.open(location, readonly=True) as reader:
            ahead = ReadAhead(meta, seg)
            commands.append([ahead.command(reader.directory.predicted_keys(q)) for q in queries])
    client.close()
    unread, buf = object(), bytearray(1 << 20)
    readers = [libvalkey.Reader(notEnoughData=unread) for _ in links]
    started = time.perf_counter()
    for i in range(len(queries)):
        for link, cmds in zip(links, commands, strict=True):
            link.sendall(cmds[i])
        for link, reader in zip(links, readers, strict=True):
            while (reply := reader.gets()) is unread:
                reader.feed(buf, 0, link.recv_into(buf))
            assert isinstance(reply, list), reply  # the READ's reply, not an error
    rate = len(queries) / (time.perf_counter() - started)
    for link in links:
        link.close()
    return rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="mooncake-format trace (default: built-in)")
    ap.add_argument("--chunk-events", type=int, default=16384)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--match-only", action="store_true",
                    help="skip the ingest passes: feed both indexes, time the matches")
    args = ap.parse_args()
    label, requests = load_requests(args.trace, 1, None, mix_ids=True)
    stream, _ = ingest.record(requests, ENGINES, 10_000)
    chunks = ingest.ops_of(stream, args.chunk_events)
    events = sum(len(c) for c in chunks)
    queries = [np.asarray(r.hashes, np.uint64) for r in requests[-args.queries:]]
    print(f"{label}: {events:,} events in {len(chunks)} chunks, {len(queries)} queries",
          flush=True)
    out: dict = {"trace": label, "events": events, "engines": ENGINES,
                 "chunk_events": args.chunk_events, "ingest": {}, "match": {}}
    with ValkeyCluster() as cluster:
        rates: dict[int, list[float]] = {} if args.match_only else {1: [], 2: [], 3: []}
        for k in range(args.repeat if rates else 0):  # interleaved: 1, 2, 3 writers, 1, 2, 3, ...
            for shards in rates:
                url = cluster.url(f"w{shards}-{k}-{uuid.uuid4().hex[:6]}")
                rates[shards].append(ingest_run(url, chunks, shards))
                for location in [*sarp.store.shard_locations(url).values(), url]:
                    drop_namespace(location)  # each pass on a server as the first found it
                print(f"pass {k + 1}, {shards} shard writer(s): {rates[shards][-1]:,.0f} "
                      "events/s", flush=True)
        for shards, r in rates.items():
            out["ingest"][shards] = {"events_per_s": statistics.median(r), "runs": r}
        # match: 3 shards against one namespace, the same stream applied to each
        one, three = cluster.url(f"one-{uuid.uuid4().hex[:6]}"), cluster.url(
            f"three-{uuid.uuid4().hex[:6]}")
        ingest_run(three, chunks, 3)
        with sarp.open(one, durability="nosync") as index:
            for chunk in chunks:
                index.apply_decoded(chunk)
        runs: dict[str, list[float]] = {"one namespace": [], "3 shards": [],
                                        "one namespace, reads alone": [],
                                        "3 shards, reads alone": []}
        shard_urls = sorted(sarp.store.shard_locations(three).values())
        with sarp.open(one, readonly=True) as whole, sarp.open_shards(three) as sharded:
            assert len(sharded.shards) == 3
            differ = sum(whole.match(q).by_holder != sharded.match(q).by_holder
                         for q in queries)
            for _ in range(args.repeat):  # interleaved
                for name, index in (("one namespace", whole), ("3 shards", sharded)):
                    runs[name].append(match_rate(index, queries))
                runs["one namespace, reads alone"].append(read_floor(cluster, [one], queries))
                runs["3 shards, reads alone"].append(read_floor(cluster, shard_urls, queries))
            for name, r in runs.items():
                out["match"][name] = {"matches_per_s": statistics.median(r), "runs": r}
        out["match"]["answers_differing"] = int(differ)
        out["match"]["floor"] = round_trip_floor(cluster, args.repeat)
    base = out["ingest"][1]["events_per_s"] if out["ingest"] else 0
    for shards, r in out["ingest"].items():
        print(f"ingest, {shards} shard writer(s): {r['events_per_s']:,.0f} events/s "
              f"({min(r['runs']):,.0f}-{max(r['runs']):,.0f}), {r['events_per_s'] / base:.2f}x "
              "one writer")
    m1, m3 = (out["match"][n]["matches_per_s"] for n in ("one namespace", "3 shards"))
    out["match"]["sharded_to_one"] = m3 / m1
    print(f"match: one namespace {m1:,.0f}/s, 3 shards {m3:,.0f}/s = {m3 / m1:.2f}x; "
          f"answers differing per engine: {out['match']['answers_differing']}")
    print(f"floor: bare round trips to 3 nodes at once / to one node: "
          f"{out['match']['floor']['three_to_one']:.2f}x")
    r1, r3 = (out["match"][n]["matches_per_s"] for n in ("one namespace, reads alone",
                                                         "3 shards, reads alone"))
    out["match"]["reads_alone_three_to_one"] = r3 / r1
    out["match"]["reads_alone_three_to_one_namespace_match"] = r3 / m1
    print(f"the matches' reads alone (no client work): one namespace {r1:,.0f}/s, 3 shards "
          f"{r3:,.0f}/s = {r3 / r1:.2f}x; 3 shards' reads alone against one namespace's "
          f"whole match: {r3 / m1:.2f}x (below 1: no client reaches parity)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
