"""serve's HTTP workers: the :class:`ConnectionDealer` that accepts connections and deals
them to worker processes, the :class:`Zygote` that forks them, and
:class:`HttpService`, which starts the workers and replaces one that died or stopped
answering.  A worker's own code (the
endpoints) is :mod:`sarp.serving.http`'s, its HTTP :mod:`sarp.serving.wire`'s.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import mmap
import os
import pickle
import signal
import socket
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("sarp.http")

STALE_S = 0.5  # a worker stamped longer ago gets no new connections ...
HUNG_S = 5.0  # ... and is killed and replaced after this
ACCEPT_RETRY_S = 0.05  # after an accept that failed (out of descriptors or memory)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """What a worker needs: the index, where the metrics go, how to hash token ids
    (serve listens; the workers are dealt accepted connections)."""

    index_path: str
    metrics_dir: str
    scheme: str = "vllm-sha256"  # vLLM's default (--prefix-caching-hash-algo sha256)
    seed: str | None = None
    block_size: int | None = None
    status_dir: str | None = None  # where the writer's status file is (default: the index)
    token: str | None = None  # the bearer token every endpoint but the probes asks for
    request_timeout_s: float = 10.0  # a request's headers and body arrive within this
    answer_timeout_s: float = 30.0  # ... and its answer goes out within this
    idle_timeout_s: float = 30.0  # a keep-alive connection with nothing asked is closed
    sharded: bool = False  # index_path is a sharded index: answer from every shard


class Heartbeats:
    """Each worker's latest stamp (``CLOCK_MONOTONIC`` seconds, one clock for every
    process; 0 until its loop runs), as doubles in a file that serve, the zygote and
    the workers map shared; ``path=None``: an anonymous map, shared by forks only.

    A spawned worker gets it pickled as its path and maps the same file.

    >>> beats = Heartbeats(None, 2)
    >>> beats[1] = 5.0; beats[0], beats[1], len(beats)
    (0.0, 5.0, 2)
    """

    def __init__(self, path: str | None, slots: int) -> None:
        self.path = path
        if path is None:
            self._map = mmap.mmap(-1, 8 * slots)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, 8 * slots)  # (new: zeros; the same size: unchanged)
                self._map = mmap.mmap(fd, 8 * slots)
            finally:
                os.close(fd)
        self._slots = memoryview(self._map).cast("d")

    def __getitem__(self, k: int) -> float:
        return self._slots[k]

    def __setitem__(self, k: int, stamp: float) -> None:
        self._slots[k] = stamp

    def __len__(self) -> int:
        return len(self._slots)

    def __reduce__(self):
        if self.path is None:
            raise TypeError("an anonymous Heartbeats is shared by fork only")
        return Heartbeats, (self.path, len(self))


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

    ``heartbeats``: the workers' stamps (:class:`Heartbeats`; default: a new
    anonymous map).  ``first``: serve's first answers (``early.FirstAnswers``), whose
    listener this takes; the dealing thread stops that child once every worker's loop
    has stamped its slot (or after ``HttpService.STARTUP_S``), then accepts.

    >>> dealer = ConnectionDealer("127.0.0.1", 0, workers=2)
    >>> len(dealer.worker_ends), dealer.listener.getsockname()[0]
    (2, '127.0.0.1')
    >>> dealer.close()
    """

    def __init__(self, host: str, port: int, workers: int,
                 heartbeats: Heartbeats | None = None, first=None) -> None:
        self._first = first
        try:
            listener = first.listener_for(host, port) if first is not None else None
            if listener is None:
                family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                            flags=socket.AI_PASSIVE)[0][0]
                listener = socket.create_server((host, port), family=family, backlog=1024)
            self.listener = listener
        except OSError as exc:
            raise ValueError(f"--http {host}:{port}: cannot listen there ({exc}); pick a free "
                             "port, or stop what holds it") from exc
        # each worker's event loop stamps its slot; a slot stamped longer ago than
        # STALE_S is dealt nothing
        self.heartbeats = Heartbeats(None, workers) if heartbeats is None else heartbeats
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                 for _ in range(workers)]
        self._ours = [a for a, _ in pairs]
        self.worker_ends = [b for _, b in pairs]  # one per worker process, passed at spawn
        self._live = list(range(workers))
        self._next = 0
        # connections not accepted, or not handed to a worker (out of descriptors,
        # memory or buffers): counted, logged, and the dealer goes on
        self.deal_errors = 0
        self._closing = False
        self._lock = threading.Lock()  # the dealing thread against renew()
        self._thread = threading.Thread(target=self._deal, name="sarp-http-dealer",
                                        daemon=True)
        self._started = False

    def sockets(self) -> list[socket.socket]:
        """Every socket of the dealer (for a forked child to close: a copy of serve's
        end of a pair would keep its worker from seeing serve go)."""
        return [self.listener, *self._ours, *self.worker_ends]

    def start(self) -> None:
        """Start dealing (after the workers were spawned with :attr:`worker_ends`)."""
        for end in self.worker_ends:
            end.close()  # the workers hold their copies
        self._thread.start()
        self._started = True

    def _deal(self) -> None:
        from .applier import RateLimitedLog

        faults = RateLimitedLog(log)
        if self._first is not None:
            self._hand_over()
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError as exc:
                if self._closing:
                    return  # closed: serve is stopping
                # out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), or a
                # connection gone before it was taken: the next one may do
                self.deal_errors += 1
                faults.warn("http", "accept", f"sarp: accepting an HTTP connection failed "
                            f"({exc}); trying again every {ACCEPT_RETRY_S:g} s")
                time.sleep(ACCEPT_RETRY_S)
                continue
            with conn, self._lock:
                with contextlib.suppress(OSError):  # the client is gone already
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while self._live:
                    k = self._pick()
                    try:
                        socket.send_fds(self._ours[k], [b"c"], [conn.fileno()])
                        break
                    except ConnectionError as exc:  # that worker is gone
                        log.error("sarp: HTTP worker %d is gone (%s); dealing to the others",
                                  k, exc)
                        self._live.remove(k)
                    except OSError as exc:  # out of memory or buffers: not this one
                        self.deal_errors += 1
                        faults.warn("http", "deal", "sarp: handing a connection to an HTTP "
                                    f"worker failed ({exc}); it is closed")
                        break
                else:
                    log.error("sarp: no HTTP worker is left; connection refused")

    def _hand_over(self) -> None:
        """Wait for every worker's first stamp (its loop runs), then stop the first
        answers' child and take the listener: one process accepts at a time."""
        deadline = time.monotonic() + HttpService.STARTUP_S
        while not self._closing and time.monotonic() < deadline and not all(
                self.heartbeats[k] > 0 for k in range(len(self.heartbeats))):
            time.sleep(0.002)
        self._first.stop()

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
        self._closing = True
        if self._first is not None:
            self._first.stop()
        with contextlib.suppress(OSError):  # closed already
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        self.listener.close()
        if self._started:
            self._thread.join(timeout=5)
        for end in self._ours + self.worker_ends:
            end.close()


class Zygote:
    """A process forked from serve before anything but the package's imports (one
    thread, no index open, no ZeroMQ, no dealer: :func:`start_zygote`, from the command
    line before serve's own module is imported), which imports the HTTP stack while
    serve goes on, and then forks the HTTP workers on request.  A worker so made
    starts in milliseconds, with every module imported, where a fresh interpreter spent
    0.35 s importing them again (the better part of serve's restart), and the workers
    share those modules' pages with the zygote.

    serve sends it a worker's config, slot and socket-pair end (``SCM_RIGHTS``) and gets
    the pid back.  It exits when serve closes its end, or dies; workers are reaped by
    the kernel (``SIGCHLD`` ignored), so a dead one's pid is gone at once.

    Given ``metrics_dir``, it also imports the event loop (uvloop) before it forks any,
    and names that folder to prometheus_client, whose multiprocess mode is chosen at
    import from the environment; a worker imports prometheus_client itself once it has
    answered a while (``http.WARM_S``), off a restart's path (docs/performance.md).

    >>> z = Zygote([], heartbeats=None)
    >>> z.alive()
    True
    >>> z.close(); z.alive()
    False
    """

    in_process = False

    def __init__(self, close_in_child: list[socket.socket], heartbeats,
                 metrics_dir: str | None = None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.metrics_dir, self.heartbeats = metrics_dir, heartbeats
        pid = os.fork()
        if pid == 0:  # the zygote
            code = 1
            try:
                ours.close()
                for sock in close_in_child:
                    sock.close()
                gc.freeze()  # (nothing of serve's is collected here: see below)
                _close_inherited(keep=theirs.fileno())
                # the workers' modules (the event loop, the HTTP stack), imported
                # here while serve imports its own and opens the index
                from .http import import_for_workers

                if metrics_dir is not None:
                    import_for_workers(metrics_dir)
                _zygote_loop(theirs, heartbeats)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        self.pid, self._control = pid, ours
        self._lock = threading.Lock()

    def fork_worker(self, config: HttpConfig, end: socket.socket, slot: int) -> int:
        """A new worker for ``slot``, serving the connections dealt over ``end``; its
        pid.  ``OSError`` when the zygote is gone."""
        with self._lock:
            self._control.settimeout(10)
            socket.send_fds(self._control, [pickle.dumps((config, slot))], [end.fileno()])
            answer = self._control.recv(8)
        if len(answer) != 8:
            raise OSError("the HTTP zygote is gone")
        return struct.unpack("<q", answer)[0]

    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def close(self) -> None:
        self._control.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _close_inherited(keep: int) -> None:
    """Close every descriptor this process was forked with but its standard streams,
    ``keep`` and open files (the heartbeats' map): the sockets, pipes and event
    descriptors ZeroMQ opened in serve above all (the engines' connections, made
    before serve's imports: serving/early.py), which a copy here would keep open after
    serve closed them.  (Their Python objects are never collected here, so never
    close a descriptor number taken since: what the zygote was forked with is frozen
    out of the collector first, and the zygote and its workers end in ``os._exit``;
    pyzmq's skip a forked child.)"""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd == keep:
            continue
        with contextlib.suppress(OSError):  # (the listing's own, closed already)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, and under a CPU quota (a
    container's ``--cpus``) the quota rounded up (:func:`quota_cores`).  Cost: a few
    small file reads.

    >>> 1 <= usable_cores() <= os.cpu_count()
    True
    """
    affinity = getattr(os, "sched_getaffinity", None)  # Linux's; elsewhere every core
    cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    try:
        membership = Path("/proc/self/cgroup").read_text()
    except OSError:
        membership = ""
    quota = quota_cores(membership, Path("/sys/fs/cgroup"))
    return max(1, cores if quota is None else min(cores, quota))


def quota_cores(membership: str, cgroups: Path) -> int | None:
    """The CPU quota in cores, rounded up, of the cgroups ``membership`` (the text of
    ``/proc/self/cgroup``) names under ``cgroups``: cgroup v2's ``cpu.max`` of the
    process's group and each above it, v1's ``cpu/cpu.cfs_quota_us`` over
    ``cfs_period_us``; the smallest, or None when there is none.

    >>> quota_cores("0::/", Path("/nonexistent")) is None
    True
    """
    pairs: list[list[str]] = []
    for line in membership.splitlines():
        if line.startswith("0::"):  # v2: the process's group and each above it
            group = cgroups / line[3:].strip("/")
            for at in (group, *group.parents):
                with contextlib.suppress(OSError):
                    pairs.append((at / "cpu.max").read_text().split()[:2])
                if at == cgroups:
                    break
    with contextlib.suppress(OSError):
        pairs.append([(cgroups / "cpu" / name).read_text().strip()
                      for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")])
    quotas = []
    for pair in pairs:
        with contextlib.suppress(ValueError, ZeroDivisionError):
            quota, period = int(pair[0]), int(pair[1])  # "max" / -1: none
            if quota > 0 and period > 0:
                quotas.append(-(-quota // period))
    return min(quotas, default=None)


MAX_DEFAULT_WORKERS = 8


def default_workers(cores: int | None = None) -> int:
    """``--http-workers`` when not given: the usable cores less one, which serve's
    writer keeps busy while engines publish, from 1 to :data:`MAX_DEFAULT_WORKERS`.
    More workers than the cores left only queue behind each other and the writer:
    on 2 cores one worker answered ``/query`` with a lower p99 than two on both
    traces (docs/performance.md, "one worker per core left").  0 (HTTP on a thread of
    serve's own, :class:`InProcess`) is the operator's to choose: half the memory, as
    many answers when idle, but a match waits for the writer's turns on the GIL while
    engines publish (docs/performance.md, "HTTP in serve's own process").

    >>> default_workers(2), default_workers(1), default_workers(16)
    (1, 1, 8)
    """
    cores = usable_cores() if cores is None else cores
    return max(1, min(MAX_DEFAULT_WORKERS, cores - 1))


def start_zygote(workers: int):
    """serve's zygote for ``workers`` HTTP workers, forked now: with a new metrics
    folder, and the workers' :class:`Heartbeats` in it (hand them to the dealer); for
    0 workers, an :class:`InProcess`, forked nothing.
    Cost: a fork, and about 50 ms of imports in the zygote, beside serve."""
    if workers == 0:
        from .inprocess import InProcess

        return InProcess()
    metrics_dir = tempfile.mkdtemp(prefix="sarp-metrics-")
    beats = Heartbeats(os.path.join(metrics_dir, "heartbeats"), workers)
    return Zygote([], beats, metrics_dir=metrics_dir)


def _zygote_loop(control: socket.socket, heartbeats) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # serve stops us (its end closes)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    gc.freeze()  # what is imported stays shared: the collector writes no page of it
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
        except OSError:
            return
        if not msg:
            for fd in fds:
                os.close(fd)
            return  # serve closed its end, or died
        config, slot = pickle.loads(msg)
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                control.close()
                for signum in (signal.SIGCHLD, signal.SIGINT):
                    signal.signal(signum, signal.SIG_DFL)
                from .http import worker_main

                worker_main(config, socket.socket(fileno=fds[0]), heartbeats, slot)
                code = 0
            except BaseException:  # noqa: BLE001 - logged, and the process ends
                log.exception("sarp: HTTP worker %d failed", slot)
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        control.send(struct.pack("<q", pid))


class _Forked:
    """A worker forked by the :class:`Zygote` (a grandchild): what ``HttpService``
    asks of a process, by pid."""

    exitcode = None  # the zygote's, not ours, to know

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:  # gone; or reaped as we look (/proc answers ESRCH): gone too
            return False
        return not stat.rpartition(")")[2].startswith(" Z")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)


def worker_pids(serve_pid: int) -> list[int]:
    """The pids of a running ``sarp serve``'s HTTP workers (the zygote's children, or
    spawned workers of serve's own), from ``/proc``.

    >>> worker_pids(os.getpid())
    []
    """
    def children(pid: int) -> list[int]:
        try:
            return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            return []

    out = []
    for child in children(serve_pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(child)  # a spawned worker
        out += children(child)  # the zygote's workers
    return sorted(out)


class HttpService:
    """serve's HTTP side: the :class:`ConnectionDealer` and the worker processes.

    :meth:`check`, called from serve's loop, replaces a worker that died (killed,
    out of memory, a bug) with a new one in its slot, at most once per
    ``RESTART_EVERY_S`` per slot, so one that cannot start does not spin.

    Cost: a worker is a process with its own readonly open of the index.
    """

    RESTART_EVERY_S = 5.0
    STARTUP_S = 30.0  # a new worker's first stamp may take this long (imports, the open)

    def __init__(self, dealer: ConnectionDealer, config: HttpConfig,
                 zygote=None, index=None) -> None:
        import multiprocessing

        self.dealer, self.config, self.zygote = dealer, config, zygote
        self.index = index  # (an InProcess's thread answers from it: serve's own)
        self._ctx = multiprocessing.get_context("spawn")
        self.procs = [self._spawn(k, end) for k, end in enumerate(dealer.worker_ends)]
        self._last_start = [time.monotonic()] * len(self.procs)
        self._stalled = [False] * len(self.procs)  # (a thread's, said once)
        self.restarts = 0
        self.hung = 0  # workers killed for missing their heartbeat
        dealer.start()

    def _spawn(self, k: int, end: socket.socket):
        """Worker ``k``: forked by the zygote, or (the zygote gone) a fresh interpreter
        (serve has threads and an open index now: it must not fork itself)."""
        self.dealer.heartbeats[k] = 0.0
        if self.zygote is not None and self.zygote.in_process:
            from .inprocess import HttpThread

            return HttpThread(self.config, end, self.dealer.heartbeats, k, self.index)
        if self.zygote is not None:
            try:
                return _Forked(self.zygote.fork_worker(self.config, end, k))
            except OSError as exc:
                log.error("sarp: the HTTP zygote is gone (%s); starting workers afresh", exc)
                self.zygote = None
        from .http import worker_main

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
            if not getattr(proc, "killable", True) and proc.is_alive():
                stalled = now - stamp > HUNG_S  # said once a stall, not replaced
                if stalled and not self._stalled[k]:
                    log.error("sarp: serve's HTTP thread has not answered for %.0f s; it "
                              "cannot be replaced in this process: restart serve, or run "
                              "--http-workers 1 or more", now - stamp)
                    self.hung += 1
                self._stalled[k] = stalled
                continue
            if proc.is_alive() and now - stamp > HUNG_S:
                log.error("sarp: HTTP worker %d (pid %s) has not answered for %.0f s; "
                          "killing it", k, proc.pid, now - self.dealer.heartbeats[k])
                self.hung += 1
                proc.kill()
                proc.join(timeout=5)
            if proc.is_alive() or now - self._last_start[k] < self.RESTART_EVERY_S:
                continue
            log.error("sarp: HTTP worker %d (pid %s) died (exit code %s); starting another",
                      k, proc.pid, "unknown" if proc.exitcode is None else proc.exitcode)
            from .http import mark_worker_dead

            if proc.pid != os.getpid():  # (a thread's metrics are serve's, which goes on)
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
        if self.zygote is not None:
            self.zygote.close()
