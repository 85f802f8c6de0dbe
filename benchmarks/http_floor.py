"""The floor under serve's ``/query`` rate on this machine (issue 26): wrk against a
C server that only reads each request and writes a fixed answer
(``benchmarks/http_floor.c``), beside ``sarp serve`` and Dynamo's standalone indexer
holding the same engines' blocks, passes interleaved.

With wrk on the same 2 cores, a service's rate is about the machine's cores over the
CPU a request costs the service and wrk together.  The C server's rate is the most any
service can reach here: what the kernel and wrk cost per request, and nothing else.
Its ratio to Dynamo's is an upper bound on what any implementation of sarp's service
could show against Dynamo on this machine.

Run from the project root (Dynamo from ``make dynamo``'s ``.venv-dynamo``; needs a C
compiler and wrk)::

    .venv/bin/python benchmarks/http_floor.py \\
        --trace ../shared/traces/mooncake_conversation.jsonl \\
        --requests 12000 --repeat 3 --json bench-results/http-floor.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import service as sv  # noqa: E402 - the services and wrk, as benchmarks/service.py runs them

import sarp.bench.conformance as cf  # noqa: E402
from sarp.bench.traces import read_requests  # noqa: E402

HERE = Path(__file__).resolve().parent


def build(work: Path) -> Path:
    """The C server, compiled into ``work``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("http_floor: no C compiler (cc or gcc) on PATH")
    out = work / "http_floor"
    subprocess.run([cc, "-O2", "-pthread", "-o", str(out), str(HERE / "http_floor.c")],
                   check=True)
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds of a process tree so far."""
    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in (root, *root.children(recursive=True)))


def floor_pass(binary: Path, threads: int, bodies: list[bytes], seconds: float,
               answer_bytes: int, work: Path) -> dict:
    port = sv._free_port()
    proc = subprocess.Popen([str(binary), str(port), str(threads), str(answer_bytes)])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                cf.post(url, "/query", b"{}", timeout_s=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        before = cpu_s(proc.pid)
        got = sv._wrk(url, bodies, seconds, work)
        got["cpu_us_per_request"] = 1e6 * (cpu_s(proc.pid) - before) / max(got["requests"], 1)
        return got
    finally:
        proc.kill()
        proc.wait()


def service_pass(kind: str, stream, bodies: list[bytes], seconds: float) -> dict:
    with sv.engines_and(kind, 8, len(stream)) as (service, pubs, _, work):
        markers = [cf.Engine(i + 1, 0, sv.MODEL, "vllm-0.33", pubs[i]) for i in range(8)]
        for n, payload in stream:
            pubs[n].publish(payload)
        cf.wait_for_markers([service.url], markers, timeout_s=600)
        before = service.cpu_s()
        got = sv._wrk(service.url, bodies, seconds, work)
        got["cpu_us_per_request"] = 1e6 * (service.cpu_s() - before) / max(got["requests"], 1)
        got["answer_bytes"] = statistics.median(
            len(json.dumps(cf.post(service.url, "/query", b)[1], separators=(",", ":")))
            for b in bodies[:200])
        return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--requests", type=int, default=12000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--services", default="floor2,floor4,sarp,dynamo",
                    help="floorN: the C server with N threads; sarp; dynamo")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    requests = [r.hashes for _, r in zip(range(args.requests), read_requests(args.trace),
                                         strict=False)]
    stream, bodies = sv.record(requests, 8), sv.queries(requests, 2000)
    kinds = args.services.split(",")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    answer_bytes = 200
    with tempfile.TemporaryDirectory(prefix="sarp-http-floor-") as tmp:
        work = Path(tmp)
        binary = build(work)
        for k in range(args.repeat):
            for kind in kinds:
                if kind.startswith("floor"):
                    got = floor_pass(binary, int(kind[5:]), bodies, args.seconds,
                                     answer_bytes, work)
                else:
                    got = service_pass(kind, stream, bodies, args.seconds)
                    answer_bytes = int(got["answer_bytes"])  # the floor answers as much
                runs[kind].append(got)
                print(f"pass {k + 1} {kind}: {got['requests_per_s']:,.0f} requests/s, p99 "
                      f"{got['p99_ms']:.2f} ms, service {got['cpu_us_per_request']:.1f} µs "
                      f"and wrk {got['client_cpu_us_per_request']:.1f} µs a request",
                      flush=True)
    median = {kind: {m: statistics.median(r[m] for r in rs) for m in rs[0]}
              for kind, rs in runs.items()}
    ratio = {}
    if "dynamo" in median:
        for kind in kinds:
            ratio[kind] = median[kind]["requests_per_s"] / median["dynamo"]["requests_per_s"]
            print(f"{kind}: {median[kind]['requests_per_s']:,.0f} requests/s, "
                  f"{ratio[kind]:.2f}x Dynamo's")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "trace": args.trace, "requests": args.requests, "seconds": args.seconds,
            "machine": {"cpus": psutil.cpu_count(), "platform": platform.platform()},
            "command": sys.argv, "runs": runs, "median": median, "ratio_to_dynamo": ratio},
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
