"""Real ``sarp serve`` processes for tests: start one, wait for it, ask it over HTTP,
read its metrics and memory, stop it.  Loopback only, every wait bounded."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def applied(index_path) -> dict[str, int] | None:
    """Per source, the sequence of the last batch a serve of the index at ``index_path``
    committed (its ``subscriber.json``, read from another process as a reader reads the
    index); None until it has written one (when it has caught up at its start)."""
    from sarp.errors import SarpError
    from sarp.serving.sources import STATE_FILE
    from sarp.store_lmdb import LmdbStore

    try:
        store = LmdbStore(Path(index_path), readonly=True)
    except SarpError:
        return None
    try:
        raw = store.load_state(STATE_FILE)
    finally:
        store.close()
    if raw is None:
        return None
    return {k: v["seq"] for k, v in json.loads(raw)["sources"].items()}


def call(port: int, method: str, path: str, body: bytes | None = None,
         timeout_s: float = 10.0, headers: dict | None = None) -> tuple[int, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        if headers is None:
            headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        ctype = resp.getheader("Content-Type", "")
        return resp.status, json.loads(data) if "json" in ctype else data.decode()
    finally:
        conn.close()


def wait_until(done, timeout_s: float, why) -> None:
    """Poll ``done()`` (an OSError counts as not yet) every 0.1 s; AssertionError with
    ``why()`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if done():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(why())


def match(port: int, payload: object, timeout_s: float = 10.0) -> tuple[int, object]:
    return call(port, "POST", "/v1/match", json.dumps(payload).encode(), timeout_s=timeout_s)


def metrics(port: int) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    _, text = call(port, "GET", "/metrics")
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def source_metric(port: int, name: str, source: str) -> float:
    return metrics(port).get((f"sarp_source_{name}_total", (("source", source),)), 0.0)


class Serve:
    """One ``sarp serve`` process; ``http`` is its port when started with HTTP."""

    def __init__(self, index: Path | str, sources: list[str], *extra: str,
                 http: bool = True, workers: int = 2, log: Path | None = None) -> None:
        self.index = str(index)
        self.port = free_port() if http else None
        cmd = [sys.executable, "-m", "sarp.cli", "serve", "--index", self.index,
               "--durability", "nosync"]
        for spec in sources:
            cmd += ["--source", spec]
        if http:
            cmd += ["--http", f"127.0.0.1:{self.port}", "--http-workers", str(workers)]
        cmd += list(extra)
        self.cmd = cmd
        self.log = Path(log or (self.index + ".serve.log"))
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(cmd, stderr=self._log_file, stdout=self._log_file)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        self.wait_for(lambda: call(self.port, "GET", "/readyz", timeout_s=2)[0] == 200,
                      timeout_s, what="/readyz")

    def wait_for(self, done, timeout_s: float = 30.0, what: str = "") -> None:
        def checked() -> bool:
            if not self.alive():
                raise AssertionError(f"sarp serve exited {self.proc.returncode} waiting for "
                                     f"{what}: {self.log.read_text()[-3000:]}")
            return done()

        wait_until(checked, timeout_s, lambda: f"timed out waiting for {what}: "
                   f"{self.log.read_text()[-3000:]}")

    def peak_rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def stop(self, timeout_s: float = 30.0) -> float:
        """SIGTERM, and the seconds it took to exit (SIGKILL after ``timeout_s``)."""
        started = time.monotonic()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log_file.close()
        return time.monotonic() - started

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
