"""serve's HTTP workers: the :class:`ConnectionDealer` that accepts connections and deals
them to worker processes, and :class:`HttpService`, which spawns the workers and
replaces one that died or stopped answering.  A worker's own code (the
endpoints) is :mod:`sarp.serving.http`'s, its HTTP :mod:`sarp.serving.wire`'s.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from .http import HttpConfig, mark_worker_dead, worker_main

log = logging.getLogger("sarp.http")

STALE_S = 0.5  # a worker stamped longer ago gets no new connections ...
HUNG_S = 5.0  # ... and is killed and replaced after this


class ConnectionDealer:
    """serve's side of the HTTP service: listens on HOST:PORT and deals each accepted
    connection to the next live worker, round robin.

    A connection's file descriptor goes to its worker over a Unix socket pair
    (``SCM_RIGHTS``); the worker serves it to the end (keep-alive included).
    Dealing in turn spreads a client's connections evenly, whatever their ports;
    one accept per connection costs serve's process a few microseconds, and
    requests never pass through it.  Binding here also means a port in use fails
    ``sarp serve`` at once, with the address in the message.

    Cost: one accept and one ``sendmsg`` per connection, on a thread of serve.

    >>> dealer = ConnectionDealer("127.0.0.1", 0, workers=2)
    >>> len(dealer.worker_ends), dealer.listener.getsockname()[0]
    (2, '127.0.0.1')
    >>> dealer.close()
    """

    def __init__(self, host: str, port: int, workers: int) -> None:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]
            self.listener = socket.create_server((host, port), family=family, backlog=1024)
        except OSError as exc:
            raise ValueError(f"--http {host}:{port}: cannot listen there ({exc}); pick a free "
                             "port, or stop what holds it") from exc
        import multiprocessing

        # each worker's event loop stamps its slot (CLOCK_MONOTONIC is one clock for
        # every process); a slot stamped longer ago than STALE_S is dealt nothing
        self.heartbeats = multiprocessing.get_context("spawn").RawArray("d", workers)
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                 for _ in range(workers)]
        self._ours = [a for a, _ in pairs]
        self.worker_ends = [b for _, b in pairs]  # one per worker process, passed at spawn
        self._live = list(range(workers))
        self._next = 0
        self._lock = threading.Lock()  # the dealing thread against renew()
        self._thread = threading.Thread(target=self._deal, name="sarp-http-dealer",
                                        daemon=True)
        self._started = False

    def start(self) -> None:
        """Start dealing (after the workers were spawned with :attr:`worker_ends`)."""
        for end in self.worker_ends:
            end.close()  # the workers hold their copies
        self._thread.start()
        self._started = True

    def _deal(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed: serve is stopping
            with conn, self._lock:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while self._live:
                    k = self._pick()
                    try:
                        socket.send_fds(self._ours[k], [b"c"], [conn.fileno()])
                        break
                    except OSError as exc:  # that worker is gone
                        log.error("sarp: HTTP worker %d is gone (%s); dealing to the others",
                                  k, exc)
                        self._live.remove(k)
                else:
                    log.error("sarp: no HTTP worker is left; connection refused")

    def _pick(self) -> int:
        """The next live worker in turn whose loop stamped its slot lately (one that
        stopped answering, SIGSTOP or a long request, gets nothing new); any live one
        when none did."""
        now = time.monotonic()
        for _ in range(len(self._live)):
            k = self._live[self._next % len(self._live)]
            self._next += 1
            if now - self.heartbeats[k] <= STALE_S:
                return k
        k = self._live[self._next % len(self._live)]
        self._next += 1
        return k

    def renew(self, k: int) -> socket.socket:
        """A new socket pair for worker slot ``k``, whose process is gone; returns the
        end for its replacement (spawn it with that, then close it here)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with self._lock:
            self._ours[k].close()
            self._ours[k] = ours
            if k not in self._live:
                self._live.append(k)
                self._live.sort()
        return theirs

    def close(self) -> None:
        """Stop accepting, and tell the workers (their socket pairs close)."""
        with contextlib.suppress(OSError):  # closed already
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        self.listener.close()
        if self._started:
            self._thread.join(timeout=5)
        for end in self._ours + self.worker_ends:
            end.close()


class HttpService:
    """serve's HTTP side: the :class:`ConnectionDealer` and the worker processes.

    :meth:`check`, called from serve's loop, replaces a worker that died (killed,
    out of memory, a bug) with a new one in its slot, at most once per
    ``RESTART_EVERY_S`` per slot, so one that cannot start does not spin.

    Cost: a worker is a process with its own readonly open of the index.
    """

    RESTART_EVERY_S = 5.0
    STARTUP_S = 30.0  # a new worker's first stamp may take this long (imports, the open)

    def __init__(self, dealer: ConnectionDealer, config: HttpConfig) -> None:
        import multiprocessing

        self.dealer, self.config = dealer, config
        self._ctx = multiprocessing.get_context("spawn")
        self.procs = [self._spawn(k, end) for k, end in enumerate(dealer.worker_ends)]
        self._last_start = [time.monotonic()] * len(self.procs)
        self.restarts = 0
        self.hung = 0  # workers killed for missing their heartbeat
        dealer.start()

    def _spawn(self, k: int, end: socket.socket):
        self.dealer.heartbeats[k] = 0.0
        proc = self._ctx.Process(target=worker_main,
                                 args=(self.config, end, self.dealer.heartbeats, k),
                                 name=f"sarp-http-{k}", daemon=True)
        proc.start()
        return proc

    def check(self) -> None:
        """Restart the workers that died since the last call."""
        now = time.monotonic()
        for k, proc in enumerate(self.procs):
            beat = self.dealer.heartbeats[k]  # 0 until its loop runs
            stamp = beat if beat > 0 else self._last_start[k] + self.STARTUP_S
            if proc.is_alive() and now - stamp > HUNG_S:
                log.error("sarp: HTTP worker %d (pid %s) has not answered for %.0f s; "
                          "killing it", k, proc.pid, now - self.dealer.heartbeats[k])
                self.hung += 1
                proc.kill()
                proc.join(timeout=5)
            if proc.is_alive() or now - self._last_start[k] < self.RESTART_EVERY_S:
                continue
            log.error("sarp: HTTP worker %d (pid %s) died with exit code %s; starting another",
                      k, proc.pid, proc.exitcode)
            mark_worker_dead(proc.pid, self.config.metrics_dir)
            end = self.dealer.renew(k)
            self.procs[k] = self._spawn(k, end)
            end.close()
            self._last_start[k] = now
            self.restarts += 1

    def close(self) -> None:
        """Stop dealing, stop the workers (SIGTERM, then SIGKILL after 5 s)."""
        self.dealer.close()  # no new connections for workers on their way out
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
