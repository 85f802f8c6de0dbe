"""serve's first milliseconds: ``POST /query`` answered from the index on disk, and the
engines followed, before numpy, the core and the HTTP stack are imported.

A restarted ``sarp serve --http`` refused connections for its first 0.2-0.25 s (its
workers answer once Python has imported numpy, the core and the HTTP stack, and the
workers are forked), and its engines' batches of that time were lost until its
subscriber connected, then replayed (docs/performance.md).  Now the command line
(:func:`start`, at the top of ``cli.main``, before anything else is imported):

* binds the HTTP listener and forks a child (:mod:`sarp.serving.first`) that imports
  only lmdb (through :mod:`sarp.lmdb_env`) and the C extension.  The child maps the
  directory snapshot and checks it, replays the log after it (``recovery``'s rules,
  numpy-free), reads the holder names and the models the last serve's status file
  named, and answers each ``/query`` in one C call (``rfc_query``: the workers' own
  fast path, byte for byte their answer) on an ``epoll`` loop over C connections
  (``wire.c``'s ``Conn``);
* then connects a SUB socket to each engine that status file names
  (:func:`connect_engines`): the engines publish to serve while it imports, and its
  subscriber adopts the sockets with what queued in them.

Each query's read transaction first catches the child's memory up with the store
(the log since its watermark; the names when they changed), as a reader's catch-up
does, so the new writer's commits are in its answers.  For any request C leaves to
the workers' general path (another route or shape, a LoRA adapter, a model the
status file did not name, no full block, a walk C hands back, a damaged record), and
for everything once a catch-up fails (the writer trimmed the log past the child's
watermark, at its next snapshot), it answers 503 with ``Retry-After: 1`` and a JSON
error naming ``service``.  ``GET /healthz`` is 200 (the child is alive), ``GET
/readyz`` 503 (readiness is the workers' to report), ``GET /workers`` the status
file's engines; the bearer token of ``--http-token-file`` is asked for as the workers
ask for it.  Without a snapshot the log still reaches back to (a first start before
serve's first snapshot), a Valkey index or shards, or without the C extension, there
is no child and the workers answer from their start, as before.

The hand-over: one process accepts at a time.  When every worker's loop has stamped
its heartbeat, serve's dealer (``workers.ConnectionDealer``) asks the child to stop
(a byte on their socket pair) and accepts as soon as the child says it no longer
does (at most ``STOP_S``, then SIGKILL); connections that came meanwhile wait in the
listener's queue, and the child answers what its open connections still ask for up
to ``first.DRAIN_S``, each answer closing its connection.  The child leaves when
serve's process is gone too.  Its bounds: ``first.MAX_CONNECTIONS`` open connections
(more are closed as they come), bodies up to ``first.MAX_BODY_BYTES``, and serve's
``--http-request-timeout-s`` and ``--http-idle-timeout-s``.

Cost: a listener and a fork in the command line (about 1 ms); in the child, about
20 ms of imports, a pass of xxh3 over the snapshot file and a record read per segment
the log names; ZeroMQ's import (about 25 ms) and two sockets an engine in serve.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from .. import native
from .access import access_token, parse_address
from .first import DRAIN_S, SNAPSHOT_FILE, serve_first
from .status import STATUS_FILE

STOP_S = 1.0  # the child's time to stop accepting once asked, then SIGKILL


class FirstAnswers:
    """serve's side of the child (see the module): the listener it bound, the child's
    pid and their socket pair.  :meth:`listener_for` hands the listener to the dealer;
    :meth:`stop` ends the child (the dealer's, once the workers run)."""

    def __init__(self, listener: socket.socket, host: str, port: int, pid: int,
                 control: socket.socket) -> None:
        self.listener, self.host, self.port = listener, host, port
        self.pid, self.control = pid, control
        self._lock = threading.Lock()

    def listener_for(self, host: str, port: int) -> socket.socket | None:
        """The listener, if it is bound where serve would bind (else the child is
        stopped and the listener closed: the dealer binds its own)."""
        if (host, port) == (self.host, self.port):
            return self.listener
        self.stop()
        self.listener.close()
        return None

    def stop(self) -> None:
        """Ask the child to stop accepting, and return once it has (or has exited, or
        after ``STOP_S``: then SIGKILL); the listener is blocking again, for the
        dealer.  The child answers what its open connections still ask for up to
        ``DRAIN_S`` more, and a thread of ours reaps it.  Idempotent."""
        with self._lock:
            if self.pid == 0:
                return
            pid, self.pid = self.pid, 0
            with contextlib.suppress(OSError):
                self.control.settimeout(STOP_S)
                self.control.send(b"s")
                if self.control.recv(1) == b"k":  # (b"": it exited)
                    threading.Thread(target=_reap, args=(pid, DRAIN_S + STOP_S),
                                     name="sarp-first-answers", daemon=True).start()
                    pid = 0
            if pid:
                _reap(pid, 0.0)
            self.control.close()
            if self.listener.fileno() >= 0:
                self.listener.setblocking(True)


class Early:
    """What :func:`start` made before serve's imports: the first answers' child (or
    None) and the engines' SUB sockets, already connected (``endpoint -> (socket,
    monitor)``, made with ``max_frame_bytes``), for serve to take."""

    def __init__(self, answers: FirstAnswers | None, engines: dict, max_frame_bytes: int
                 ) -> None:
        self.answers, self.engines, self.max_frame_bytes = answers, engines, max_frame_bytes

    def take_engines(self, max_frame_bytes: int) -> dict:
        """The engines' sockets, handed over (they were made with this
        ``max_frame_bytes``; else closed, and {}): nothing of them stays here."""
        engines, self.engines = self.engines, {}
        if max_frame_bytes != self.max_frame_bytes:
            close_engines(engines)
            return {}
        return engines

    def close(self) -> None:
        """Stop the child; close the sockets serve did not take.  Idempotent."""
        if self.answers is not None:
            self.answers.stop()
        close_engines(self.take_engines(-1))


def close_engines(engines: dict) -> None:
    """Close each (socket, monitor) of ``engines``; it is empty after."""
    for sock, monitor in engines.values():
        monitor.close(linger=0)
        sock.close(linger=0)
    engines.clear()


def start(argv: list[str]) -> Early | None:
    """For ``sarp serve ARGS`` (``argv``: the ARGS), before anything but the command
    line's own modules is imported, on an index folder a serve left: when serve
    answers HTTP and a snapshot is there, bind the listener and fork the first
    answers' child; then connect to the engines the last serve's status file named,
    so that they publish to serve while it imports (their batches wait in ZeroMQ's
    queues).  None when there is nothing to do; serve then starts as before, and its
    own parse says what is wrong with its flags.

    Only flags spelled out in full are read here; anything unexpected means nothing
    is done early.
    """
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--index", "--http", "--http-token-file", "--shard", "--max-frame-bytes",
                 "--http-request-timeout-s", "--http-idle-timeout-s"):
        p.add_argument(flag)
    p.add_argument("--http-allow-unauthenticated", action="store_true")
    try:
        args, _ = p.parse_known_args(argv)
        if not args.index or args.shard or "://" in args.index \
                or not (Path(args.index) / STATUS_FILE).is_file():
            return None
        max_frame_bytes = int(args.max_frame_bytes or 64 << 20)
    except (SystemExit, ValueError):
        return None
    answers = _fork_answers(args) if args.http else None
    return Early(answers, connect_engines(Path(args.index), max_frame_bytes), max_frame_bytes)


def _fork_answers(args) -> FirstAnswers | None:
    try:
        if native.C is None or sys.byteorder != "little" \
                or not (Path(args.index) / SNAPSHOT_FILE).is_file():
            return None
        host, port = parse_address(args.http)
        logging.disable(logging.WARNING)  # (serve says it, once its logging is set up)
        try:
            token = access_token(args.http, args.http_token_file,
                                 args.http_allow_unauthenticated)
        finally:
            logging.disable(logging.NOTSET)
        request_s = float(args.http_request_timeout_s or 10.0)
        idle_s = float(args.http_idle_timeout_s or 30.0)
        if not (0 < request_s < 1e6 and 0 < idle_s < 1e6):
            return None
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        listener = socket.create_server((host, port), family=family, backlog=1024)
    except (ValueError, OSError):  # serve's parse and dealer say it properly
        return None
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            ours.close()
            serve_first(listener, theirs, Path(args.index), token, request_s, idle_s,
                        os.getppid())
        except BaseException:  # noqa: BLE001 - the workers answer instead; nothing to say
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    return FirstAnswers(listener, host, port, pid, ours)


def sub_socket(ctx, endpoint: str, max_frame_bytes: int) -> tuple:
    """An engine's SUB socket as serve follows it (everything subscribed, nothing
    dropped on our side, frames over ``max_frame_bytes`` refused) and its monitor
    (connects and disconnects), connected to ``endpoint``.  ``zmq.ZMQError`` when out
    of sockets (nothing left open)."""
    import zmq

    opened = []
    try:
        opened.append(sock := ctx.socket(zmq.SUB))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        opened.append(monitor := sock.get_monitor_socket(zmq.EVENT_CONNECTED
                                                         | zmq.EVENT_DISCONNECTED))
        sock.connect(endpoint)
    except zmq.ZMQError:
        for s in opened:
            s.close(linger=0)
        raise
    return sock, monitor


def zmq_context(ctx=None):
    """``ctx``, or serve's ZeroMQ context (the process's), with room for as many sockets
    as the system allows (ZeroMQ's default, 1,023, held about 250 engines; effective
    before the context's first socket)."""
    import zmq

    ctx = ctx or zmq.Context.instance()
    ctx.set(zmq.MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT))
    return ctx


def connect_engines(folder: Path, max_frame_bytes: int) -> dict[str, tuple]:
    """SUB sockets (and monitors) connected to each endpoint the status file in
    ``folder`` lists; as many as the process may open.  Cost: ZeroMQ's import (about
    25 ms) and two sockets an engine."""
    try:
        engines = json.loads((folder / STATUS_FILE).read_text()).get("engines", [])
        endpoints = sorted({e["endpoint"] for e in engines if isinstance(e, dict)
                            and isinstance(e.get("endpoint"), str)})
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    if not endpoints:
        return {}
    import zmq

    ctx, out = zmq_context(), {}
    for endpoint in endpoints:
        try:
            out[endpoint] = sub_socket(ctx, endpoint, max_frame_bytes)
        except zmq.ZMQError:  # out of sockets, or an endpoint ZeroMQ refuses: serve's
            continue
    return out


def _reap(pid: int, within_s: float) -> None:
    """Wait up to ``within_s`` for the child to exit, then SIGKILL it; reaped."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                time.sleep(0.005)
                continue
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
