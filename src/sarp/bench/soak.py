"""The soak: ``sarp serve --http`` under every fault at once, every answer checked.

16 simulated engines publish vLLM events over loopback ZeroMQ: one of them with a
hostile replay endpoint (:class:`~sarp.bench.cluster.HostileEngine`), one that
dies for good, one that restarts.  8 HTTP clients ask for chains the engines served
and check every answer against the engines' caches: each block an instance is said
to hold must be in that engine's cache, or have left it within the last second (or,
for the engine that died, within the liveness timeout after its death).  One more
client sends the largest requests serve takes, and 500 connections stay idle.  On
the way one HTTP worker is SIGSTOPped (serve kills and replaces it), serve is
SIGKILLed and started again 3 times, and on Valkey the server is restarted once
(with AOF).  ``/healthz`` is probed every 20 ms, and the RSS of serve and its
workers sampled every second.

Answers given while serve is down or not yet ready after a restart are not
checked: a router asks ``/readyz`` then (until serve has checked the engines again,
its index is the one it had when it was killed).  They are counted.

    python -m sarp.bench.soak --seconds 120             # LMDB
    python -m sarp.bench.soak --seconds 120 --valkey    # Valkey, restarted once

It prints the figures and exits 1 when an answer was false, serve stopped by itself,
``/healthz``'s p99 was over 50 ms or the RSS over ``--max-rss-mib``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from ..serving.workers import worker_pids
from .cluster import EnginePublisher, HostileEngine, SimEngine

ENGINES = 16
CAPACITY_BLOCKS = 2_000
EVICTED_GRACE_S = 1.0
PROBE_AFTER_S, DEAD_AFTER_S = 2.0, 2.0
MAX_BLOCKS = 1 << 18  # serve's most blocks in one request


_PROBER = r"""
import http.client, sys, time
port, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w", buffering=1) as out:
    while True:
        at, started = time.time(), time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/healthz")
            ok = conn.getresponse().status == 200
            conn.close()
        except (OSError, http.client.HTTPException):
            ok = False
        out.write(f"{at} {1000 * (time.perf_counter() - started)} {int(ok)}\n")
        time.sleep(0.02)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engines:
    """The simulated engines, the chains they served, and when each block left them."""

    def __init__(self, ctx: zmq.Context, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.engines = [SimEngine(f"e{i}", CAPACITY_BLOCKS, EnginePublisher(ctx))
                        for i in range(ENGINES - 1)]
        self.hostile = HostileEngine(ctx)
        self.evicted_at: dict[str, dict[int, float]] = {e.holder: {} for e in self.engines}
        self.dead_at: dict[str, float] = {}
        self.recent: list[list[int]] = []
        self.roots = [[self.rng.getrandbits(63) for _ in range(4)] for _ in range(60)]

    def specs(self) -> list[str]:
        out = [f"{e.name}={e.publisher.endpoint},{e.publisher.replay_endpoint}"
               for e in self.engines]
        return out + [f"bad={self.hostile.endpoint},{self.hostile.replay_endpoint}"]

    def step(self) -> None:
        """One request served by a live engine, its evictions stamped."""
        with self.lock:
            live = [e for e in self.engines if e.holder not in self.dead_at]
            engine = self.rng.choice(live)
            chain = self.rng.choice(self.roots) + [self.rng.getrandbits(63)
                                                    for _ in range(self.rng.randrange(2, 12))]
            before = set(engine.cache)
            engine.serve(chain)
            now = time.monotonic()
            gone = self.evicted_at[engine.holder]
            for block in before.difference(engine.cache):
                gone[block] = now
            if len(gone) > 200_000:
                for block in [b for b, t in gone.items() if now - t > 10]:
                    del gone[block]
            self.recent.append(chain)
            if len(self.recent) > 5000:
                del self.recent[:1000]

    def kill(self, index: int) -> None:
        """Engine ``index`` dies for good: nothing more from it, its blocks gone."""
        with self.lock:
            engine = self.engines[index]
            self.dead_at[engine.holder] = time.monotonic()
            engine.publisher.close()

    def restart(self, index: int) -> None:
        """Engine ``index`` restarts: an empty cache, sequences from 0, new sockets."""
        with self.lock:
            engine = self.engines[index]
            now = time.monotonic()
            for block in engine.cache:
                self.evicted_at[engine.holder][block] = now
            engine.cache.clear()
            engine.publisher.restart(rebind=True)

    def false_claims(self, chain: list[int], answer: dict, sent_at: float) -> list[str]:
        """The claims of ``answer`` for ``chain`` that no engine backs."""
        wrong = []
        with self.lock:
            by_name = {e.holder: e for e in self.engines}
            for inst in answer["instances"]:
                engine = by_name.get(inst["instance"])
                k = inst["matched_blocks"]
                if engine is None:
                    wrong.append(f"{inst['instance']} named for {k} blocks")
                    continue
                died = self.dead_at.get(engine.holder)
                if died is not None and sent_at <= died + PROBE_AFTER_S + DEAD_AFTER_S + 1:
                    continue  # serve learns of a death by asking, after its timeouts
                gone = self.evicted_at[engine.holder]
                for block in chain[:k]:
                    if block not in engine.cache and \
                            gone.get(block, -1e9) < sent_at - EVICTED_GRACE_S:
                        wrong.append(f"{engine.holder}: block {block} of {k} not held")
                        break
        return wrong

    def close(self) -> None:
        for e in self.engines:
            if e.holder not in self.dead_at:
                e.publisher.close()
        self.hostile.close()


class Serve:
    """``sarp serve --http`` as a process, killed and started again on demand."""

    def __init__(self, index: str, specs: list[str], log_path: Path, http_workers: int = 2
                 ) -> None:
        self.port = _free_port()
        self.cmd = [sys.executable, "-m", "sarp.cli", "serve", "--index", index,
                    "--durability", "nosync", "--http", f"127.0.0.1:{self.port}",
                    "--http-workers", str(http_workers), "--hash-scheme", "vllm-sha256-cbor",
                    "--hash-seed", "0", "--block-size", "16",
                    "--probe-after-s", str(PROBE_AFTER_S), "--dead-after-s", str(DEAD_AFTER_S),
                    "--replay-budget-s", "3", "--replay-idle-timeout-s", "1",
                    "--snapshot-every-s", "5"]
        if index.startswith("valkey://"):
            # the killed serve's lease lasts its --lease-s: the new one waits it out
            self.cmd += ["--lease-s", "3", "--wait-for-lease-s", "30"]
        for spec in specs:
            self.cmd += ["--source", spec]
        self.log = log_path.open("a")
        self.proc: subprocess.Popen | None = None
        self.exits: list[int] = []  # exit codes of serves that stopped by themselves

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=self.log)

    def ready(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/readyz")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.ready():
                return time.monotonic() - started
            time.sleep(0.05)
        raise RuntimeError("sarp serve did not get ready")

    def alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            self.exits.append(self.proc.returncode)
            self.proc = None
        return self.proc is not None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def pids(self) -> list[int]:
        """serve, its zygote and its HTTP workers."""
        if self.proc is None:
            return []
        out = [self.proc.pid]
        with contextlib.suppress(OSError):
            out += [int(p) for p in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
                    .read_text().split()]
        return sorted(set(out) | set(self.workers()))

    def workers(self) -> list[int]:
        return [] if self.proc is None else worker_pids(self.proc.pid)

    def rss_bytes(self) -> int:
        total = 0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class Soak:
    def __init__(self, args) -> None:
        self.args = args
        self.stop = threading.Event()
        self.stable = threading.Event()  # serve up and ready since the last fault of ours
        self.generation = 0  # bumped at every restart of serve
        self.unstable: list[tuple[float, float]] = []  # wall-clock spans serve was not ready
        self.counts = {"answers_checked": 0, "false_answers": 0, "unchecked_in_restart": 0,
                       "http_errors": 0, "max_requests": 0, "max_request_errors": 0,
                       "max_request_unavailable": 0}
        self.false_samples: list[str] = []
        self.healthz_ms: list[float] = []
        self.healthz_failures = 0
        self.rss_max = 0
        self.lock = threading.Lock()

    # -- the clients ---------------------------------------------------------------------

    def client(self, engines: Engines, serve: Serve, seed: int) -> None:
        rng = random.Random(seed)
        conn = None
        while not self.stop.is_set():
            if not engines.recent:
                time.sleep(0.01)
                continue
            chain = rng.choice(engines.recent)
            query = chain[: rng.randrange(1, len(chain) + 1)]
            gen, stable = self.generation, self.stable.is_set()
            sent = time.monotonic()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=10)
                conn.request("POST", "/v1/match", json.dumps({"block_hashes": query}),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                body = resp.read()
            except (OSError, http.client.HTTPException):
                conn = None
                with self.lock:
                    self.counts["http_errors"] += 1
                time.sleep(0.05)
                continue
            checked = stable and self.stable.is_set() and gen == self.generation
            with self.lock:
                if resp.status != 200 or not checked:
                    self.counts["unchecked_in_restart" if not checked else "http_errors"] += 1
                    continue
                wrong = engines.false_claims(query, json.loads(body), sent)
                self.counts["answers_checked"] += 1
                if wrong:
                    self.counts["false_answers"] += 1
                    if len(self.false_samples) < 10:
                        self.false_samples.extend(wrong[:2])
            time.sleep(0.005)

    def maximal_client(self, serve: Serve) -> None:
        """The largest requests serve takes: 262,144 one-token blocks hashed in vLLM's
        scheme, and 262,144 block hashes."""
        bodies = [json.dumps({"token_ids": list(range(MAX_BLOCKS)), "block_size": 1}).encode(),
                  json.dumps({"block_hashes": list(range(1, MAX_BLOCKS + 1))}).encode()]
        i = 0
        while not self.stop.is_set():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
                conn.request("POST", "/v1/match", bodies[i % 2],
                             {"Content-Type": "application/json"})
                status = conn.getresponse().status
                conn.close()
                with self.lock:
                    self.counts["max_requests"] += 1
                    # 503: the index could not be read then (Valkey restarting), as said
                    self.counts["max_request_unavailable"] += status == 503
                    self.counts["max_request_errors"] += status not in (200, 503)
            except (OSError, http.client.HTTPException):
                time.sleep(0.2)
            i += 1

    def idle_connections(self, serve: Serve, count: int) -> None:
        socks: list[socket.socket] = []
        while not self.stop.is_set():
            alive = []
            for s in socks:  # serve closes idle ones after its idle timeout: open again
                try:
                    s.setblocking(False)
                    if s.recv(1) == b"":
                        s.close()
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    continue
                alive.append(s)
            socks = alive
            while len(socks) < count and not self.stop.is_set():
                try:
                    socks.append(socket.create_connection(("127.0.0.1", serve.port), timeout=2))
                except OSError:
                    break
            self.stop.wait(1.0)
        for s in socks:
            s.close()

    def start_prober(self, serve: Serve, path: Path) -> subprocess.Popen:
        """``/healthz`` every 20 ms from a process of its own, so that the load this
        process makes does not show in the latencies: one ``wall_time ms ok`` line
        each, read at the end (:meth:`probe_figures`)."""
        return subprocess.Popen([sys.executable, "-c", _PROBER, str(serve.port), str(path)])

    def probe_figures(self, path: Path) -> None:
        """Keep the probes that started and ended while serve was up and ready."""
        for line in path.read_text().splitlines():
            at, ms, ok = line.split()
            start, end = float(at), float(at) + float(ms) / 1000
            if any(a <= end and start <= b for a, b in self.unstable):
                continue
            if ok == "1":
                self.healthz_ms.append(float(ms))
            else:
                self.healthz_failures += 1

    # -- the run -------------------------------------------------------------------------

    def run(self) -> dict:
        args = self.args
        ctx = zmq.Context.instance()
        work = Path(tempfile.mkdtemp(prefix="sarp-soak-"))
        valkey = None
        if args.valkey:
            from .valkey_server import ValkeyServer

            valkey = ValkeyServer(aof=True, folder=work / "valkey")
            index = valkey.url("soak")
        else:
            index = str(work / "ix")
        engines = Engines(ctx, args.seed)
        serve = Serve(index, engines.specs(), work / "serve.log", args.http_workers)
        with_workers = args.http_workers > 0  # (0: HTTP on serve's own thread, none to stop)
        events: list[str] = []
        restarts_s: list[float] = []
        replaced_worker = first_kill = stopped_worker = None
        prober = None
        try:
            for _ in range(50):
                engines.step()
            serve.start()
            serve.wait_ready()
            self.stable.set()
            threads = [threading.Thread(target=self.client, args=(engines, serve, i),
                                        daemon=True) for i in range(8)]
            threads += [threading.Thread(target=self.maximal_client, args=(serve,), daemon=True),
                        threading.Thread(target=self.idle_connections, args=(serve, 500),
                                         daemon=True)]
            prober = self.start_prober(serve, work / "healthz.txt")
            for t in threads:
                t.start()
            total = args.seconds
            # the worker stopped well before serve is first killed: serve must replace it
            plan = sorted([(0.10, "engine dies"), (0.40, "serve killed"), (0.50, "engine restarts"),
                           (0.70, "serve killed"), (0.90, "serve killed")]
                          + ([(0.60, "valkey restarted")] if valkey else [])
                          + ([(0.12, "worker stopped")] if with_workers else []))
            started = time.monotonic()
            while time.monotonic() - started < total or plan:  # every fault, even if late
                engines.step()
                now = time.monotonic() - started
                if plan and now >= plan[0][0] * total:
                    _, what = plan.pop(0)
                    events.append(f"{now:.1f} s: {what}")
                    if what == "engine dies":
                        engines.kill(3)
                    elif what == "engine restarts":
                        engines.restart(5)
                    elif what == "worker stopped":
                        workers = serve.workers()
                        if workers:
                            stopped_worker = workers[0]
                            os.kill(stopped_worker, signal.SIGSTOP)
                    elif what == "serve killed":
                        first_kill = now if first_kill is None else first_kill
                        self.stable.clear()
                        self.generation += 1
                        down = time.time()
                        serve.kill()
                        serve.start()
                        restarts_s.append(serve.wait_ready())
                        self.unstable.append((down, time.time()))
                        self.stable.set()
                    elif what == "valkey restarted":
                        port = valkey.port
                        valkey.stop()
                        valkey = type(valkey)(aof=True, folder=work / "valkey", port=port)
                if stopped_worker is not None and replaced_worker is None \
                        and serve.proc is not None and stopped_worker not in serve.workers():
                    replaced_worker = time.monotonic() - started
                if not serve.alive():
                    events.append(f"{now:.1f} s: serve stopped by itself "
                                  f"(exit {serve.exits[-1]}); started again")
                    self.stable.clear()
                    self.generation += 1
                    down = time.time()
                    serve.start()
                    serve.wait_ready()
                    self.unstable.append((down, time.time()))
                    self.stable.set()
                if int(now * 10) % 10 == 0:
                    self.rss_max = max(self.rss_max, serve.rss_bytes())
                time.sleep(1 / args.requests_per_s)
            self.stop.set()
            prober.terminate()
            prober.wait(timeout=10)
            self.probe_figures(work / "healthz.txt")
            for t in threads:
                t.join(timeout=70)
        finally:
            self.stop.set()
            if prober is not None and prober.poll() is None:
                prober.kill()
            if stopped_worker is not None:  # left stopped if serve had not replaced it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped_worker, signal.SIGKILL)
            serve.stop()
            engines.close()
            if valkey is not None:
                valkey.stop()
        ms = np.array(self.healthz_ms) if self.healthz_ms else np.array([0.0])
        result = {
            "store": "valkey" if args.valkey else "lmdb", "seconds": args.seconds,
            **self.counts, "false_samples": self.false_samples,
            "serve_stopped_by_itself": serve.exits,
            "healthz_probes": len(self.healthz_ms), "healthz_failures": self.healthz_failures,
            "healthz_p50_ms": float(np.percentile(ms, 50)),
            "healthz_p99_ms": float(np.percentile(ms, 99)),
            "healthz_max_ms": float(ms.max()),
            "rss_max_mib": self.rss_max / (1 << 20),
            "restart_to_ready_s": restarts_s,
            "stopped_worker_replaced_at_s": replaced_worker,
            "worker_replaced_by_serve": replaced_worker is not None and (
                first_kill is None or replaced_worker < first_kill),
            "events": events,
        }
        result["http_workers"] = args.http_workers
        result["ok"] = (result["false_answers"] == 0 and not serve.exits
                        and result["healthz_p99_ms"] <= 50
                        and result["rss_max_mib"] <= args.max_rss_mib
                        and (result["worker_replaced_by_serve"] or not with_workers))
        if result["ok"]:
            shutil.rmtree(work, ignore_errors=True)  # kept, with serve's log, when not
        else:
            result["kept"] = str(work)
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sarp.bench.soak",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--valkey", action="store_true", help="the index on a valkey-server")
    parser.add_argument("--requests-per-s", type=float, default=150.0,
                        help="requests the engines serve each second, together")
    parser.add_argument("--max-rss-mib", type=float, default=1536.0,
                        help="serve and its workers together, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http-workers", type=int, default=2,
                        help="serve's --http-workers (0: HTTP on a thread of serve's own, on "
                        "a folder index; no worker to stop and see replaced)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = Soak(args).run()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
