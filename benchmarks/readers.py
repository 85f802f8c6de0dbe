"""Readers beside a writer, and the HTTP service (issue 8's figures).

    .venv/bin/python benchmarks/readers.py --trace ../shared/traces/mooncake_conversation.jsonl \\
        --json bench-results/readers-mooncake.json --plot bench-results/readers-mooncake.png

Three measurements on one index built from the trace (hashes mixed like engines'):

(a) match throughput of 1 and 2 reader processes (``readonly=True``) while a real
    ``sarp serve`` ingests a simulated cluster's events as fast as it can apply them,
    against the same readers while it is idle; passes interleaved (idle, busy, idle,
    busy, ...), medians with min and max;
(b) visibility lag: a writer inserts a new block every 1-3 ms; a reader process
    matches it in a loop; lag = the reader's first match that sees it minus the
    moment ``insert`` returned in the writer (CLOCK_MONOTONIC, shared by processes);
(c) ``POST /v1/match`` latency and requests/s with 8 concurrent clients (one
    asyncio process, keep-alive) against ``sarp serve --http`` with 2 workers, and
    the same queries answered in-process by ``router.score_match``; interleaved.

The event stream: 4 engines with LRU caches serve the trace with random routing,
recorded once (vLLM encodings); a publisher process replays it over real ZeroMQ
sockets, keeping at most ``--max-ahead`` batches ahead of what serve has applied, so
"busy" is serve's full apply rate and "idle" starts with no backlog.  Before any
measurement serve applies the whole recorded stream once (a fixed amount, so the
index measured does not depend on how fast serve is); (c) runs on exactly that
index, then (a).

The busy passes of (a) replay a second recording: the same engines serving the same
trace with every hash XORed with a constant, chains the readers never ask for.  serve
does the same work per event, and the readers' matches find exactly what they find
while idle.  Replaying the first stream instead changed what the readers matched: a
recording that wraps around starts over from empty caches on an index holding their
end state, and the readers of one run matched 1,712 blocks per match while busy
against 815 while idle, so the ratio measured the index's contents, not the writer.
Each pass reports its blocks per match, and they must agree.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import sarp
from sarp.bench import load_requests
from sarp.bench.ingest import record

ENGINES = 4
BUSY_XOR = 0x9E3779B97F4A7C15  # the busy stream's chains: the trace's, hashes XORed with this


# -- building ------------------------------------------------------------------------------


def build_index(folder: Path, requests) -> None:
    """Replay the trace into an index: match, then insert what is new (round-robin holders)."""
    with sarp.open(folder, durability="nosync") as index:
        for i, r in enumerate(requests):
            n = index.match(r.hashes).num_blocks
            if n < r.hashes.size:
                index.insert(r.hashes[n:], parent=int(r.hashes[n - 1]) if n else None,
                             holder=f"e{i % ENGINES}#0")


# -- the publisher process -----------------------------------------------------------------


def publisher_main(events_file: str, endpoints_out, control, state_path: str,
                   max_ahead: int) -> None:
    import zmq

    from sarp.bench.cluster import EnginePublisher

    with open(events_file, "rb") as f:
        import pickle

        warm_events, busy_events = pickle.load(f)
    ctx = zmq.Context.instance()
    pubs = [EnginePublisher(ctx, buffer_batches=200_000) for _ in range(ENGINES)]
    endpoints_out.send([(p.endpoint, p.replay_endpoint) for p in pubs])
    on, published, limit = False, 0, None
    at = {"warm": 0, "busy": 0}  # where each recording is up to
    while True:
        if control.poll(0 if on else 0.05):
            cmd = control.recv()
            if cmd == "stop":
                break
            # "on", "off", or ("until", N): publish until N batches in all, then stop
            on = cmd == "on" or isinstance(cmd, tuple)
            limit = cmd[1] if isinstance(cmd, tuple) else None
            control.send(("ok", published))
        if not on:
            continue
        if limit is not None and published >= limit:
            on = False
            continue
        if published - _applied(state_path) > max_ahead:
            time.sleep(0.002)  # serve is behind: wait (cheaply) for it to apply
            continue
        # ("until", N) replays the warm-up recording, "on" the busy one (disjoint chains)
        which, events = ("busy", busy_events) if limit is None else ("warm", warm_events)
        for _ in range(max_ahead // 4 if limit is None else min(max_ahead // 4,
                                                                 limit - published)):
            engine, payload = events[at[which] % len(events)]
            pubs[engine].publish(payload)
            at[which] += 1
            published += 1
    for p in pubs:
        p.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _applied(state_path: str) -> int:
    """Batches serve has applied, from its subscriber.json (sum of sequences + 1)."""
    try:
        sources = json.loads(Path(state_path).read_text())["sources"]
    except (FileNotFoundError, ValueError, KeyError):
        return 0
    return sum(v["seq"] + 1 for v in sources.values())


# -- readers -------------------------------------------------------------------------------


def reader_main(path: str, queries_file: str, duration_s: float, start_at: float, conn) -> None:
    with np.load(queries_file) as data:
        flat, offsets = data["flat"], data["offsets"]
    queries = [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    index = sarp.open(path, readonly=True)
    index.match(queries[0])
    while time.monotonic() < start_at:
        time.sleep(0.001)
    done, blocks = 0, 0
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        blocks += index.match(queries[done % len(queries)]).num_blocks
        done += 1
    conn.send((done / duration_s, blocks / max(done, 1)))
    index.close()


def run_readers(path: str, queries_file: str, n: int, duration_s: float
                ) -> tuple[float, float]:
    """Matches/s of ``n`` reader processes together, and their blocks per match."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    start_at = time.monotonic() + 1.5  # after every reader has opened
    for _ in range(n):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=reader_main, args=(path, queries_file, duration_s, start_at,
                                                     there))
        proc.start()
        pipes.append(here)
        procs.append(proc)
    answers = [conn.recv() for conn in pipes]
    for proc in procs:
        proc.join()
    return sum(a[0] for a in answers), statistics.mean(a[1] for a in answers)


# -- (b) visibility lag --------------------------------------------------------------------


def lag_reader(path: str, base: int, count: int, conn) -> None:
    index = sarp.open(path, readonly=True)
    seen = []
    conn.send("ready")
    for k in range(count):
        while index.match([base + k]).num_blocks == 0:
            pass
        seen.append(time.monotonic_ns())
    conn.send(seen)
    index.close()


def visibility_lag(path: Path, count: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    base = 1 << 62
    ctx = mp.get_context("spawn")
    with sarp.open(path, durability="nosync") as writer:
        here, there = ctx.Pipe()
        proc = ctx.Process(target=lag_reader, args=(str(path), base, count, there))
        proc.start()
        assert here.recv() == "ready"
        committed = []
        for k in range(count):
            time.sleep(float(rng.uniform(0.001, 0.003)))
            writer.insert([base + k], holder="lag#0")
            committed.append(time.monotonic_ns())
        seen = here.recv()
        proc.join()
        writer.remove([base + k for k in range(count)], holder="lag#0")
    return [(s - c) / 1e6 for s, c in zip(seen, committed, strict=True)]


# -- (c) HTTP ------------------------------------------------------------------------------


def http_client_main(port: int, bodies: list[bytes], duration_s: float, clients: int,
                     conn) -> None:
    import aiohttp

    async def one(session, k: int, lat: list[float], end: float) -> None:
        i = k
        while time.monotonic() < end:
            t = time.perf_counter()
            async with session.post(f"http://127.0.0.1:{port}/v1/match",
                                    data=bodies[i % len(bodies)],
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")
            lat.append(time.perf_counter() - t)
            i += clients

    async def main() -> list[float]:
        lat: list[float] = []
        connector = aiohttp.TCPConnector(limit=clients)
        async with aiohttp.ClientSession(connector=connector) as session:
            end = time.monotonic() + duration_s
            await asyncio.gather(*(one(session, k, lat, end) for k in range(clients)))
        return lat

    import uvloop  # the server's event loop too; a cheaper client leaves it more CPU

    conn.send(uvloop.run(main()))


def inprocess_main(path: str, queries_file: str, duration_s: float, conn) -> None:
    from sarp.serving.router import score_match

    with np.load(queries_file) as data:
        flat, offsets = data["flat"], data["offsets"]
    queries = [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    index = sarp.open(path, readonly=True)
    lat, i = [], 0
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        t = time.perf_counter()
        score_match(index, queries[i % len(queries)], block_size=16)
        lat.append(time.perf_counter() - t)
        i += 1
    index.close()
    conn.send(lat)


def in_child(target, *args):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, there))
    proc.start()
    out = here.recv()
    proc.join()
    return out


def summarize_latency(lat: list[float], duration_s: float) -> dict:
    arr = np.array(lat) * 1e3
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99)),
            "requests_per_s": len(lat) / duration_s, "requests": len(lat)}


# -- the run -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, timeout_s: float = 60) -> None:
    import http.client

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("sarp serve --http did not get ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None)
    ap.add_argument("--limit-requests", type=int, default=None)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--pass-s", type=float, default=3.0)
    ap.add_argument("--capacity-blocks", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3, help="trace rounds in the event stream")
    ap.add_argument("--max-ahead", type=int, default=2000)
    ap.add_argument("--lag-samples", type=int, default=1000)
    ap.add_argument("--http-workers", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()

    label, requests = load_requests(args.trace, 1, args.limit_requests, mix_ids=True)
    work = Path(tempfile.mkdtemp(prefix="sarp-readers-", dir=args.workdir))
    path = work / "ix"
    print(f"{label}: {len(requests)} requests; building the index in {path}", flush=True)
    build_index(path, requests)
    queries = [r.hashes for r in requests[1::2]]
    queries_file = str(work / "queries.npz")
    offsets = np.cumsum([0] + [q.size for q in queries])
    np.savez(queries_file, flat=np.concatenate(queries), offsets=offsets)
    events, _ = record(requests, ENGINES, args.capacity_blocks, seed=1, rounds=args.rounds)
    elsewhere = [dataclasses.replace(r, hashes=r.hashes ^ np.uint64(BUSY_XOR)) for r in requests]
    busy_events, _ = record(elsewhere, ENGINES, args.capacity_blocks, seed=1,
                            rounds=args.rounds)
    events_file = str(work / "events.pkl")
    with open(events_file, "wb") as f:
        import pickle

        pickle.dump((events, busy_events), f)
    print(f"recorded {len(events)} event batches, and as many on disjoint chains for the "
          "busy passes", flush=True)

    ctx = mp.get_context("spawn")
    ep_here, ep_there = ctx.Pipe()
    ctl_here, ctl_there = ctx.Pipe()
    publisher = ctx.Process(target=publisher_main,
                            args=(events_file, ep_there, ctl_there,
                                  str(path / "subscriber.json"), args.max_ahead))
    publisher.start()
    endpoints = ep_here.recv()
    port = free_port()
    cmd = [sys.executable, "-m", "sarp.cli", "serve", "--index", str(path), "--durability",
           "nosync", "--http", f"127.0.0.1:{port}", "--http-workers", str(args.http_workers),
           "--report-every-s", "3600"]
    for i, (pub, replay) in enumerate(endpoints):
        cmd += ["--source", f"e{i}={pub},{replay}"]
    serve = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    result: dict = {"trace": label, "requests": len(requests), "settings": vars(args) | {
        "json": str(args.json), "plot": str(args.plot)}, "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()}, "sarp": sarp.__version__}
    try:
        wait_http(port)
        pids = {"serve": serve.pid, "publisher": publisher.pid}
        # Warm up by a fixed amount, not a fixed time: the whole recorded stream once
        # (evictions, new branches), so the index every pass sees does not depend on
        # how fast serve applies. The HTTP passes answer from exactly that state.
        _ingest_batches(ctl_here, path / "subscriber.json", len(events))
        result["http"] = http_passes(args, port, str(path), queries, queries_file)
        result["throughput"] = throughput_passes(args, str(path), queries_file, ctl_here, pids)
    finally:
        ctl_here.send("stop")
        publisher.join(timeout=10)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    lags = visibility_lag(path, args.lag_samples, seed=2)
    result["visibility_lag_ms"] = {"p50": float(np.percentile(lags, 50)),
                                   "p99": float(np.percentile(lags, 99)),
                                   "max": float(max(lags)), "samples": len(lags)}
    report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


def throughput_passes(args, path: str, queries_file: str, control, pids: dict) -> dict:
    state = Path(path) / "subscriber.json"
    out: dict = {}
    for n in (1, 2):
        idle, busy, applied, cores, idle_blocks, busy_blocks = [], [], [], [], [], []
        for _ in range(args.passes):
            rate, blocks = run_readers(path, queries_file, n, args.pass_s)
            idle.append(rate)
            idle_blocks.append(blocks)
            control.send("on")
            control.recv()
            time.sleep(0.5)
            before, t0 = _applied(str(state)), time.monotonic()
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            rate, blocks = run_readers(path, queries_file, n, args.pass_s)
            busy.append(rate)
            busy_blocks.append(blocks)
            wall = time.monotonic() - t0
            applied.append((_applied(str(state)) - before) / wall)
            cores.append({k: (cpu_seconds(p) - cpu0[k]) / wall for k, p in pids.items()})
            _stop_and_drain(control, state)
        ratios = [b / i for b, i in zip(busy, idle, strict=True)]
        out[f"{n}_readers"] = {"idle_matches_per_s": idle, "busy_matches_per_s": busy,
                               "ratio": ratios, "ratio_median": statistics.median(ratios),
                               "idle_blocks_per_match": idle_blocks,
                               "busy_blocks_per_match": busy_blocks,
                               "serve_batches_per_s_while_busy": applied,
                               "cores_used_while_busy": cores}
        print(f"{n} reader(s): busy/idle {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}); blocks per match "
              f"{statistics.median(idle_blocks):.1f} idle, {statistics.median(busy_blocks):.1f}"
              f" busy; serve applied {statistics.median(applied):,.0f} batches/s meanwhile, "
              f"using {statistics.median(c['serve'] for c in cores):.2f} cores (publisher "
              f"{statistics.median(c['publisher'] for c in cores):.2f})", flush=True)
    return out


def _ingest_batches(control, state: Path, count: int) -> None:
    """Have the publisher send ``count`` batches, and serve apply them all."""
    control.send(("until", count))
    _, published = control.recv()
    deadline = time.monotonic() + 600
    while _applied(str(state)) < published + count and time.monotonic() < deadline:
        time.sleep(0.05)
    _stop_and_drain(control, state)


def _stop_and_drain(control, state: Path) -> None:
    control.send("off")
    _, published = control.recv()
    deadline = time.monotonic() + 120
    while _applied(str(state)) < published and time.monotonic() < deadline:
        time.sleep(0.05)  # drain: the next idle pass starts with no backlog


WRK_SCRIPT = """
local bodies, i = {}, 0
init = function(args)
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
end
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", "/v1/match", {["Content-Type"] = "application/json"}, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"p50_us": %d, "p99_us": %d, "requests": %d, "errors": %d}\\n',
    latency:percentile(50), latency:percentile(99), summary.requests,
    e.status + e.connect + e.read + e.write + e.timeout))
end
"""


def wrk_pass(port: int, bodies_file: str, script_file: str, duration_s: float) -> dict:
    """8 connections from one wrk thread (C: a client that costs the server little CPU)."""
    out = subprocess.run(["wrk", "-t1", "-c8", f"-d{max(1, round(duration_s))}s", "-s", script_file,
                          f"http://127.0.0.1:{port}", "--", bodies_file],
                         capture_output=True, text=True, timeout=duration_s + 60)
    line = [x for x in out.stdout.splitlines() if x.startswith('{"p50_us"')][-1]
    r = json.loads(line)
    if r["errors"]:
        raise RuntimeError(f"wrk saw {r['errors']} errors:\n{out.stdout}")
    return {"p50_ms": r["p50_us"] / 1e3, "p99_ms": r["p99_us"] / 1e3,
            "requests_per_s": r["requests"] / duration_s, "requests": r["requests"]}


def http_passes(args, port: int, path: str, queries, queries_file: str) -> dict:
    import shutil

    bodies = [json.dumps({"block_hashes": q.tolist(), "block_size": 16}).encode()
              for q in queries]
    work = Path(queries_file).parent
    bodies_file, script_file = str(work / "bodies.txt"), str(work / "match.lua")
    Path(bodies_file).write_bytes(b"\n".join(bodies) + b"\n")
    Path(script_file).write_text(WRK_SCRIPT)
    use_wrk = shutil.which("wrk") is not None
    runs: dict[str, list] = {"http_python_8_clients": [], "http_wrk_8_connections": [],
                             "in_process": []}
    for _ in range(args.passes):
        lat = in_child(http_client_main, port, bodies, args.pass_s, 8)
        runs["http_python_8_clients"].append(summarize_latency(lat, args.pass_s))
        if use_wrk:
            runs["http_wrk_8_connections"].append(wrk_pass(port, bodies_file, script_file,
                                                           args.pass_s))
        lat = in_child(inprocess_main, path, queries_file, args.pass_s)
        runs["in_process"].append(summarize_latency(lat, args.pass_s))

    out: dict = {"runs": runs}
    for name, rs in runs.items():
        if not rs:
            continue
        for key in ("p50_ms", "p99_ms", "requests_per_s"):
            out[f"{name}_{key}"] = statistics.median(r[key] for r in rs)
        out[f"{name}_p99_ms_range"] = [min(r["p99_ms"] for r in rs),
                                       max(r["p99_ms"] for r in rs)]
        print(f"{name}: p50 {out[name + '_p50_ms']:.3f} ms, p99 {out[name + '_p99_ms']:.3f} ms "
              f"({out[name + '_p99_ms_range'][0]:.2f}-{out[name + '_p99_ms_range'][1]:.2f}), "
              f"{out[name + '_requests_per_s']:,.0f} req/s", flush=True)
    return out


def report(result: dict) -> None:
    lag = result["visibility_lag_ms"]
    print(f"visibility lag: p50 {lag['p50']:.3f} ms, p99 {lag['p99']:.3f} ms, "
          f"max {lag['max']:.3f} ms over {lag['samples']} writes")


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    for k, n in enumerate((1, 2)):
        r = result["throughput"][f"{n}_readers"]
        ax.boxplot(r["ratio"], positions=[k], widths=0.5)
    ax.axhline(0.8, ls="--", c="gray", lw=1)
    ax.set_xticks([0, 1], ["1 reader", "2 readers"])
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("matches/s while serve ingests / idle")
    ax.set_title("(a) readers beside a busy writer")
    ax = axes[1]
    lag = result["visibility_lag_ms"]
    ax.bar(["p50", "p99", "max"], [lag["p50"], lag["p99"], lag["max"]])
    ax.axhline(5, ls="--", c="gray", lw=1)
    ax.set_ylabel("ms from insert returning to a reader seeing it")
    ax.set_title("(b) visibility lag")
    ax = axes[2]
    h = result["http"]
    series = [("http_python_8_clients", "HTTP, 8 Python clients"),
              ("http_wrk_8_connections", "HTTP, wrk 8 connections"), ("in_process", "in-process")]
    series = [(k, label) for k, label in series if f"{k}_p50_ms" in h]
    width = 0.8 / len(series)
    for j, (k, label) in enumerate(series):
        ax.bar([j * width, 1 + j * width], [h[f"{k}_p50_ms"], h[f"{k}_p99_ms"]], width=width,
               label=label)
    ax.axhline(5, ls="--", c="gray", lw=1)
    ax.set_xticks([0.4 - width / 2, 1.4 - width / 2], ["p50", "p99"])
    ax.set_ylabel("ms per match request")
    ax.set_title("(c) /v1/match latency")
    ax.legend()
    fig.suptitle(result["trace"])
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
