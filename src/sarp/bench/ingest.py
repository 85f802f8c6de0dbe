"""``sarp bench-events``: how fast events get into the index, measured as indexers measure it.

The event stream is recorded once: the engines of ``sarp cluster`` (LRU caches)
serve the trace with random routing, each request one batch in the engines' own
encodings (vLLM 0.11 and 0.33 in turn).  Then:

(a) **backlog**: the whole stream is published over loopback ZeroMQ to a real
    :class:`~sarp.serving.subscriber.Subscriber` that is not reading yet; the clock
    runs from its first poll until everything is applied; at ``nosync`` and at
    ``sync``, interleaved; events/s and blocks/s;
(b) **offered rate**: a publisher process offers the stream at a sweep of rates
    (each batch stamped with its publish time, as engines stamp ``ts``); achieved
    events/s, and the p50/p99 lag from publish to committed; the threshold is the
    highest offered rate with achieved >= 95% of offered and p99 lag <= 100 ms;
(c) **baselines**: the same stream's operations applied directly (no sockets) to
    memory-dict, lmdb-per-block and sarp, in chunks of ``--chunk-events`` (by
    default the subscriber's ``MAX_BATCH_OPS``, what ``sarp serve`` commits at most
    in one transaction while it catches up), one transaction each for the on-disk
    ones, each through its event applier (sarp's is the one ``sarp serve`` runs:
    decoded hashes are not checked again);
(d) the index is compared with the engines' caches at the end of (a).
"""

from __future__ import annotations

import json
import math
import mmap
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TS = struct.Struct(">d")


class _Recorder:
    def __init__(self, sink: list, engine: int) -> None:
        self.sink, self.engine = sink, engine

    def publish(self, payload: bytes, drop: bool = False) -> int:
        self.sink.append((self.engine, payload))
        return len(self.sink)


class StreamFile:
    """A recorded stream on disk, for the sweep's publisher process: payloads back to
    back in ``path``, and each batch's offset, engine and event count in
    ``path.npz``, so that a stream of hundreds of MB is not pickled to it.

    Use it as :func:`record`'s sink, then :meth:`close`; :meth:`load` maps it.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self.offsets, self.engines, self.events = [0], [], []

    def append(self, item: tuple[int, bytes]) -> None:
        from ..serving.events import decode

        engine, payload = item
        if payload[:2] not in (b"\x93\xcb", b"\x92\xcb"):  # stamped in place when offered
            raise ValueError(f"batch {len(self.engines)} does not start with [float64 ts, ...]")
        self._file.write(payload)
        self.offsets.append(self.offsets[-1] + len(payload))
        self.engines.append(engine)
        self.events.append(len(decode(payload).events))

    def __len__(self) -> int:
        return len(self.engines)

    def close(self) -> None:
        # On disk before the sweep: hundreds of MB written back while a rate is
        # offered would stall it (the built-in stream's 5,000 events/s showed p99 lags
        # of 150-230 ms)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        np.savez(f"{self.path}.npz", offsets=np.array(self.offsets, np.int64),
                 engines=np.array(self.engines, np.int32),
                 events=np.array(self.events, np.int64))

    @staticmethod
    def load(path: str) -> tuple[mmap.mmap, dict]:
        """The payloads (mapped: a slice is a ``bytes``) and the batch table."""
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with np.load(f"{path}.npz") as table:
            return data, dict(table)


def record(requests, engines: int, capacity_blocks: int, seed: int = 0, rounds: int = 1,
           sink=None):
    """The stream (engine, payload) of ``rounds`` passes over the requests, and the
    engines' caches at its end.  The stream goes to ``sink`` (anything with
    ``append`` and ``len``, such as a :class:`StreamFile`) when given, else to a
    list."""
    from .cluster import SimEngine

    rng = np.random.default_rng(seed)
    stream = [] if sink is None else sink
    sims = [SimEngine(f"e{i}", capacity_blocks, _Recorder(stream, i)) for i in range(engines)]
    styles = ("vllm-0.11", "vllm-0.33")
    for k in range(rounds):
        for j, r in enumerate(requests):
            sims[int(rng.integers(engines))].serve(r.hashes, style=styles[(j + k) % 2])
    return stream, [set(s.cache) for s in sims]


def count(stream) -> tuple[int, int, list[int]]:
    """Events, blocks, and events per batch of the stream."""
    from ..serving.events import Cleared, decode

    per_batch, blocks = [], 0
    for _, payload in stream:
        batch = decode(payload)
        per_batch.append(len(batch.events))
        blocks += sum(0 if isinstance(e, Cleared) else e.block_hashes.size for e in batch.events)
    return sum(per_batch), blocks, per_batch


TOKEN_MODEL = "bench"  # the model of the engines whose blocks are keyed by their tokens


def backlog(stream, engines: int, caches, durability: str, workdir: str,
            token_keys: bool = False, where: str | None = None) -> dict:
    """Events/s draining the whole stream, published at once, through serve's
    subscriber into an index in ``workdir`` (or at ``where``, a Valkey URL)."""
    import zmq

    import sarp

    from ..serving.serve import collector_tuned
    from ..serving.subscriber import Source, Subscriber
    from .cluster import EnginePublisher

    ctx = zmq.Context.instance()
    pubs = [EnginePublisher(ctx, buffer_batches=len(stream) + 1) for _ in range(engines)]
    folder = Path(tempfile.mkdtemp(prefix=f"sarp-ingest-{durability}-", dir=workdir))
    try:
        with sarp.open(where or folder / "ix", durability=durability) as index:
            model = TOKEN_MODEL if token_keys else None
            sub = Subscriber(index, [Source(f"e{i}", p.endpoint, p.replay_endpoint,
                                            model=model, block_size=16 if model else None)
                                     for i, p in enumerate(pubs)])
            time.sleep(0.3)  # connected before the first publish
            for engine, payload in stream:
                pubs[engine].publish(payload)
            total = len(stream)
            time.sleep(0.5)  # everything is in the SUB socket's queue
            with collector_tuned():  # as sarp serve runs the loop
                started = time.perf_counter()
                while sum(sub.last_seq.get(f"e{i}", -1) + 1 for i in range(engines)) < total:
                    sub.poll(10)
                seconds = time.perf_counter() - started
            stats = [s.applied for s in sub.stats.values()]
            # token keys are not the engines' hashes: then the counts are compared
            equal = all(set(index.blocks_of(f"e{i}#0").tolist()) == caches[i] if not model
                        else index.blocks_of(f"e{i}#0").size == len(caches[i])
                        for i in range(engines))
            commits = index.stats()["batches"]
            sub.close()
    finally:
        for p in pubs:
            p.close()
        shutil.rmtree(folder, ignore_errors=True)
    events = sum(s.events for s in stats)
    blocks = sum(s.blocks_stored + s.blocks_removed for s in stats)
    return {"events_per_s": events / seconds, "blocks_per_s": blocks / seconds,
            "seconds": seconds, "commits": commits, "index_equals_caches": equal}


# -- (b) offered rates ------------------------------------------------------------------------


def _offer_main(path: str, engines: int, rate: float, seconds: float, conn) -> None:
    """A publisher process: the stream file's batches, paced to ``rate`` events/s,
    stamped."""
    import zmq

    from .cluster import EnginePublisher

    data, table = StreamFile.load(path)
    offsets, engine_of, per_batch = table["offsets"], table["engines"], table["events"]
    ctx = zmq.Context.instance()
    pubs = [EnginePublisher(ctx, buffer_batches=10_000) for _ in range(engines)]
    conn.send([(p.endpoint, p.replay_endpoint) for p in pubs])
    conn.recv()  # the subscriber is connected
    start = time.perf_counter()
    sent_events = sent = 0
    total = len(engine_of)
    while time.perf_counter() - start < seconds and sent < total:
        due = start + sent_events / rate
        now = time.perf_counter()
        if due > now:
            time.sleep(min(due - now, 0.005))
            continue
        a, b = int(offsets[sent]), int(offsets[sent + 1])
        # The batch's ts is its first element, a msgpack float64 after the array
        # header: stamp the publish time there, as engines do.
        stamped = data[a:a + 2] + TS.pack(time.time()) + data[a + 10:b]
        pubs[int(engine_of[sent])].publish(stamped)
        sent_events += int(per_batch[sent])
        sent += 1
    conn.send((sent, sent_events, time.perf_counter() - start))
    conn.recv()
    for p in pubs:
        p.close()


def offered(stream_path: str, engines: int, rate: float, seconds: float,
            workdir: str) -> dict:
    import sarp

    from ..serving.serve import collector_tuned
    from ..serving.subscriber import Source, Subscriber

    lags: list[float] = []
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_offer_main, args=(stream_path, engines, rate, seconds, there))
    proc.start()
    endpoints = here.recv()
    folder = Path(tempfile.mkdtemp(prefix="sarp-offered-", dir=workdir))

    def on_commit(fps) -> None:
        now = time.time()
        lags.extend(now - fp.ts for fp in fps)

    with sarp.open(folder / "ix", durability="nosync") as index:
        sub = Subscriber(index, [Source(f"e{i}", pub, replay)
                                 for i, (pub, replay) in enumerate(endpoints)],
                         on_commit=on_commit)
        time.sleep(0.3)
        with collector_tuned():  # as sarp serve runs the loop
            here.send("go")
            started = time.perf_counter()
            result = None
            while True:
                sub.poll(5)
                if result is None and here.poll(0):
                    result = here.recv()
                if result is not None and sum(sub.last_seq.get(f"e{i}", -1) + 1
                                              for i in range(engines)) >= result[0]:
                    break
                if time.perf_counter() - started > seconds + 120:
                    break
            wall = time.perf_counter() - started
        events = sum(s.applied.events for s in sub.stats.values())
        sub.close()
    here.send("done")
    proc.join(timeout=10)
    shutil.rmtree(folder, ignore_errors=True)
    lag_ms = np.array(lags) * 1e3 if lags else np.array([float("nan")])
    return {"offered_events_per_s": rate, "achieved_events_per_s": events / wall,
            "seconds": wall,
            "lag_p50_ms": float(np.percentile(lag_ms, 50)),
            "lag_p99_ms": float(np.percentile(lag_ms, 99)), "batches": len(lags)}


# -- (c) direct appliers ----------------------------------------------------------------------


def ops_of(stream, chunk_events: int, root: int | None = None) -> list[list[tuple]]:
    """The stream as index operations, in chunks of about ``chunk_events`` events
    (``root``: as serve's applier makes them for engines keyed by their tokens)."""
    from ..serving.events import Cleared, Removed, Stored, decode

    chunks, ops = [], []
    for engine, payload in stream:
        holder = f"e{engine}#0"
        for e in decode(payload, root is not None).events:
            if isinstance(e, Stored):
                ops.append(("insert", e.block_hashes, e.parent, holder, e.medium)
                           if root is None else
                           ("insert_engine", e.block_hashes, e.parent, holder, e.medium, root,
                            e.token_ids, e.block_size, e.lora_name))
            elif isinstance(e, Removed):
                ops.append(("remove", e.block_hashes, holder, e.medium) if root is None
                           else ("remove_engine", e.block_hashes, holder, e.medium, root))
            elif isinstance(e, Cleared):
                ops.append(("clear", holder, None))
        if len(ops) >= chunk_events:
            chunks.append(ops)
            ops = []
    if ops:
        chunks.append(ops)
    return chunks


def direct(name: str, chunks, workdir: str, where: str | None = None) -> dict:
    """Events/s applying the operations straight to index ``name`` (sarp: at ``where``
    when given, a Valkey URL), under serve's collector settings."""
    from ..serving.serve import collector_tuned
    from .baselines import opener

    folder = Path(tempfile.mkdtemp(prefix=f"sarp-direct-{name}-", dir=workdir))
    index = opener(name.removesuffix("-token-keys"))(where or folder / "ix",
                                                     durability="nosync")
    events = sum(len(c) for c in chunks)
    with collector_tuned():  # as serve's applier runs
        started = time.perf_counter()
        for chunk in chunks:
            if name.startswith("sarp"):
                index.apply_decoded(chunk)  # what serve's event applier calls
            else:
                index.apply_ops(chunk)
        seconds = time.perf_counter() - started
    index.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {"events_per_s": events / seconds, "seconds": seconds}


# -- the command ------------------------------------------------------------------------------


def _drop(where: str | None) -> None:
    """A pass's namespace deleted once measured, as an LMDB pass's folder is: on a
    server that kept every pass's index, each pass ran slower than the one before
    (the direct apply on Mooncake, 5 passes: 87,888 events/s down to 53,138)."""
    if where is not None:
        from ..valkey_shards import drop_namespace

        drop_namespace(where)


def _against_lmdb(args, work: str, stream, caches, label: str, events: int) -> int:
    """``--index URL``: the backlog drain and the direct apply on that index against
    LMDB, nosync both, passes interleaved, medians and ratios; nothing else."""
    import uuid

    from ..serving.subscriber import MAX_BATCH_OPS

    chunks = ops_of(stream, args.chunk_events or MAX_BATCH_OPS)
    base = args.index.rstrip("/")
    runs: dict[str, dict[str, list[float]]] = {"backlog": {"lmdb": [], "index": []},
                                               "direct": {"lmdb": [], "index": []}}
    equal = True
    for k in range(args.repeat):  # interleaved: LMDB, the index, LMDB, the index, ...
        for name in ("lmdb", "index"):
            where = None if name == "lmdb" else f"{base}-drain-{k}-{uuid.uuid4().hex[:6]}"
            b = backlog(stream, args.engines, caches, "nosync", work, where=where)
            equal &= b["index_equals_caches"]
            runs["backlog"][name].append(b["events_per_s"])
            _drop(where)
            where = None if name == "lmdb" else f"{base}-apply-{k}-{uuid.uuid4().hex[:6]}"
            runs["direct"][name].append(direct("sarp", chunks, work, where)["events_per_s"])
            _drop(where)
    result: dict = {"trace": label, "events": events, "index": args.index,
                    "command": " ".join(sys.argv), "index_equals_caches": equal}
    for kind, by in runs.items():
        med = {name: statistics.median(r) for name, r in by.items()}
        result[kind] = {"lmdb": med["lmdb"], "index": med["index"],
                        "index_to_lmdb": med["index"] / med["lmdb"], "runs": by}
        print(f"{kind}: {args.index} {med['index']:,.0f} events/s ({min(by['index']):,.0f}-"
              f"{max(by['index']):,.0f}), LMDB {med['lmdb']:,.0f} ({min(by['lmdb']):,.0f}-"
              f"{max(by['lmdb']):,.0f}): {med['index'] / med['lmdb']:.2f}x (medians of "
              f"{args.repeat}, interleaved)", flush=True)
    print(f"index = caches: {equal}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if equal else 1


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="sarp-bench-events-", dir=args.workdir) as work:
        return _run(args, work)


def _run(args, work: str) -> int:
    from ..serving.subscriber import MAX_BATCH_OPS
    from .run import load_requests

    if args.chunk_events is None:
        args.chunk_events = MAX_BATCH_OPS

    label, requests = load_requests(args.trace, args.split, args.limit_requests,
                                    mix_ids=True)
    print(f"{label}: recording the event stream of {args.engines} engines x "
          f"{args.capacity_blocks:,} blocks", flush=True)
    stream, caches = record(requests, args.engines, args.capacity_blocks)
    events, blocks, per_batch = count(stream)
    print(f"{len(stream):,} batches, {events:,} events, {blocks:,} blocks", flush=True)
    if args.index is not None:
        return _against_lmdb(args, work, stream, caches, label, events)
    result: dict = {"trace": label, "engines": args.engines,
                    "capacity_blocks": args.capacity_blocks, "batches": len(stream),
                    "events": events, "blocks": blocks, "command": " ".join(sys.argv),
                    "machine": {"platform": platform.platform(),
                                "python": platform.python_version()}}
    result["backlog"] = {}
    drains: dict[str, list[dict]] = {"nosync": [], "sync": []}
    for _ in range(args.repeat):  # interleaved: nosync, sync, nosync, sync, ...
        for durability, runs in drains.items():
            runs.append(backlog(stream, args.engines, caches, durability, work))
    for durability, runs in drains.items():
        best = {k: statistics.median(r[k] for r in runs)
                for k in ("events_per_s", "blocks_per_s", "seconds")}
        best["runs"] = runs
        best["index_equals_caches"] = all(r["index_equals_caches"] for r in runs)
        result["backlog"][durability] = best
        print(f"backlog {durability}: {best['events_per_s']:,.0f} events/s, "
              f"{best['blocks_per_s']:,.0f} blocks/s (median of {args.repeat}); index = "
              f"caches: {best['index_equals_caches']}", flush=True)
    # the same drain with the engines' blocks keyed by their tokens (interleaved with
    # today's engine keys, nosync both)
    keyed: dict[str, list[dict]] = {"engine keys": [], "token keys": []}
    for _ in range(args.repeat):
        for name, runs in keyed.items():
            runs.append(backlog(stream, args.engines, caches, "nosync", work,
                                token_keys=name == "token keys"))
    result["backlog_keys"] = {name: {"events_per_s": statistics.median(
        r["events_per_s"] for r in runs), "runs": runs} for name, runs in keyed.items()}
    ratio = (result["backlog_keys"]["token keys"]["events_per_s"]
             / result["backlog_keys"]["engine keys"]["events_per_s"])
    result["backlog_keys"]["token_to_engine_ratio"] = ratio
    print(f"backlog nosync, token keys: {result['backlog_keys']['token keys']['events_per_s']:,.0f}"
          f" events/s = {ratio:.2f}x engine keys (medians of {args.repeat}, interleaved)",
          flush=True)
    result["index_equals_caches"] = all(b["index_equals_caches"]
                                        for b in result["backlog"].values()) and all(
        r["index_equals_caches"] for runs in keyed.values() for r in runs)
    # Every rate is offered for rate_s seconds: the sweep's stream is as many passes
    # over the requests as the top rate needs (later passes evict more, so this is
    # enough), in a file the publisher process maps.
    rounds = max(1, math.ceil(max(args.rates) * args.rate_s / events))
    print(f"recording the sweep's stream: {rounds} passes over the requests", flush=True)
    sweep_stream = StreamFile(Path(work) / "sweep-stream")
    record(requests, args.engines, args.capacity_blocks, rounds=rounds, sink=sweep_stream)
    sweep_stream.close()
    result["sweep_stream"] = {"passes": rounds, "batches": len(sweep_stream),
                              "events": int(sum(sweep_stream.events))}
    result["sweep"] = []
    for rate in args.rates:
        point = offered(str(sweep_stream.path), args.engines, rate, args.rate_s, work)
        result["sweep"].append(point)
        print(f"offered {rate:>8,.0f} events/s: achieved {point['achieved_events_per_s']:>8,.0f}"
              f", lag p50 {point['lag_p50_ms']:.1f} ms, p99 {point['lag_p99_ms']:.1f} ms"
              f" ({point['seconds']:.1f} s)", flush=True)
    ok = [p["offered_events_per_s"] for p in result["sweep"]
          if p["achieved_events_per_s"] >= 0.95 * p["offered_events_per_s"]
          and p["lag_p99_ms"] <= 100]
    result["threshold_events_per_s"] = max(ok) if ok else 0
    from ..tokenkeys import model_root

    chunks = {"": ops_of(stream, args.chunk_events),
              "-token-keys": ops_of(stream, args.chunk_events, model_root(TOKEN_MODEL))}
    result["chunk_events"] = args.chunk_events
    result["baselines"] = {}
    order = ["sarp", "sarp-token-keys", "memory-dict", "lmdb-per-block"]
    runs = {name: [] for name in order}
    for _ in range(args.repeat):  # interleaved: A, B, C, A, B, C, ...
        for name in order:
            ops = chunks["-token-keys" if name.endswith("-token-keys") else ""]
            runs[name].append(direct(name, ops, work)["events_per_s"])
    for name in order:
        result["baselines"][name] = {"events_per_s": statistics.median(runs[name]),
                                     "runs": runs[name]}
    sarp_direct = result["baselines"]["sarp"]["events_per_s"]
    for name in order[2:]:
        ratio = sarp_direct / result["baselines"][name]["events_per_s"]
        result["baselines"][name]["sarp_ratio"] = ratio
        print(f"direct apply: sarp {sarp_direct:,.0f} events/s = {ratio:.2f}x {name} "
              f"({result['baselines'][name]['events_per_s']:,.0f})", flush=True)
    tokens = result["baselines"]["sarp-token-keys"]
    tokens["to_engine_keys"] = tokens["events_per_s"] / sarp_direct
    print(f"direct apply with token keys: {tokens['events_per_s']:,.0f} events/s = "
          f"{tokens['to_engine_keys']:.2f}x engine keys", flush=True)
    print(f"threshold: {result['threshold_events_per_s']:,.0f} events/s", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    offered_rates = [p["offered_events_per_s"] for p in result["sweep"]]
    left.plot(offered_rates, [p["achieved_events_per_s"] for p in result["sweep"]], "o-",
              label="achieved")
    left.plot(offered_rates, offered_rates, "--", c="gray", lw=1, label="offered")
    left.set_xlabel("offered events/s")
    left.set_ylabel("achieved events/s")
    twin = left.twinx()
    twin.plot(offered_rates, [p["lag_p99_ms"] for p in result["sweep"]], "s:", c="C3",
              label="p99 lag")
    twin.set_ylabel("p99 publish-to-applied lag, ms", color="C3")
    twin.set_yscale("log")
    left.legend(loc="upper left")
    left.set_title(f"offered rate (threshold {result['threshold_events_per_s']:,.0f}/s)")
    names = ["backlog nosync", "backlog sync"] + [f"direct {n}" for n in result["baselines"]]
    values = [result["backlog"]["nosync"]["events_per_s"],
              result["backlog"]["sync"]["events_per_s"]] + [
        b["events_per_s"] for b in result["baselines"].values()]
    right.barh(names, values)
    right.set_xscale("log")
    right.set_xlabel("events/s (log)")
    right.set_title("drain rates")
    fig.suptitle(f"{result['trace']}: {result['engines']} engines, {result['events']:,} events")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
