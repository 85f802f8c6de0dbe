"""``sarp serve --http-workers 0``: HTTP on a thread of serve's own process, answering
from the writer's own index.

One process instead of serve, a zygote and a worker: half the memory, since nothing is
loaded twice (docs/performance.md, "HTTP in serve's own process").  A ``/query`` is
answered in C (``rfc.answer_now``) from the writer's memory between its commits: the
writer changes memory only in ``Index._apply``, under a lock of its own
(``Index.reading().memory_lock``), and its long C calls give a waiting thread the GIL
(``gil_turn`` in ``native.h``).  The price is the GIL: while engines publish, a match
waits for the writer's turns (about Python's switch interval, 1 ms here), where a worker
process answers at once; and a thread that stops answering cannot be replaced, only
reported (``HttpService.check``).  The dealer, the endpoints and their bounds are the
workers' (:mod:`sarp.serving.workers`, :mod:`sarp.serving.http`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import threading

from . import wire
from .http import SWITCH_INTERVAL_S, import_for_workers, make_server, stamping
from .workers import Heartbeats, HttpConfig

log = logging.getLogger("sarp.http")


class InProcess:
    """What serve keeps for ``--http-workers 0`` where a ``workers.Zygote`` would be: the
    metrics folder (named to prometheus_client), one heartbeat slot, and the event loop
    imported; the HTTP server runs on a thread of serve's own (:class:`HttpService`).

    >>> home = InProcess(); home.alive(), len(home.heartbeats)
    (True, 1)
    >>> home.close(); import shutil; shutil.rmtree(home.metrics_dir)
    """

    in_process = True

    def __init__(self) -> None:
        self.metrics_dir = tempfile.mkdtemp(prefix="sarp-metrics-")
        self.heartbeats = Heartbeats(os.path.join(self.metrics_dir, "heartbeats"), 1)
        import_for_workers(self.metrics_dir)

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


class HttpThread:
    """serve's HTTP on a thread of its own (:func:`serve_http`):
    what ``HttpService`` asks of a worker.  A thread cannot be killed: one that stops
    stamping is reported, not replaced; one that ended (an error, logged) is."""

    exitcode = None
    killable = False

    def __init__(self, config: HttpConfig, end: socket.socket, heartbeats, slot: int,
                 index) -> None:
        self.pid = os.getpid()
        end = end.dup()  # (the caller closes its own, as after a fork)
        self._thread = threading.Thread(target=self._main,
                                        args=(config, end, heartbeats, slot, index),
                                        name="sarp-http", daemon=True)
        self._thread.start()

    @staticmethod
    def _main(config: HttpConfig, end: socket.socket, heartbeats, slot: int, index) -> None:
        try:
            serve_http(config, end, index, heartbeats, slot)
        except BaseException:  # noqa: BLE001 - logged; HttpService starts another
            log.exception("sarp: serve's HTTP thread failed")

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def kill(self) -> None:
        pass

    terminate = kill

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def serve_http(config: HttpConfig, channel: socket.socket, index, heartbeats=None,
               slot: int = 0) -> None:
    """The server a worker process runs (``http.worker_main``), on ``index``, the
    writer's own, for the connections dealt over ``channel``; until serve closes its
    end.  It stamps ``heartbeats[slot]`` as a worker does; the signals stay serve's."""
    # the GIL handed over every millisecond, not every 5: a match waits less behind the
    # writer's Python (whose long C calls give it turns: native.h, gil_turn)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    chores = [] if heartbeats is None else [lambda: stamping(heartbeats, slot)]
    wire.run(make_server(index, config), channel, chores, signals=False)
