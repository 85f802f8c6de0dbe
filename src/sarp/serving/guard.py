"""Time bounds on an HTTP connection, which aiohttp lacks but for keep-alive: a request's
headers and body within ``request_timeout_s`` of its first byte, its answer within
``answer_timeout_s``, and at most ``idle_timeout_s`` between requests
(:class:`sarp.serving.http.HttpConfig`).  Before them, half-sent requests held
connections for ever.  Cost: one timestamp per read, one sweep of the connections
every second or so.
"""

from __future__ import annotations

import asyncio
import time


class Guard(asyncio.Protocol):
    """Wraps aiohttp's protocol for one connection to bound its time (see the module;
    ``config`` has the three timeouts); :func:`sweep` enforces them."""

    def __init__(self, inner, guards: dict, config) -> None:
        self.inner, self.guards, self.config = inner, guards, config
        self.transport = None
        self.pending_since: float | None = None  # first byte of a request not yet answered
        self.inflight_since: float | None = None  # handler running since
        self.last_activity = time.monotonic()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.guards[transport] = self
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        self.last_activity = now
        if self.pending_since is None and self.inflight_since is None:
            self.pending_since = now
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self.guards.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def started(self) -> None:
        self.pending_since, self.inflight_since = None, time.monotonic()

    def answered(self) -> None:
        self.inflight_since, self.last_activity = None, time.monotonic()

    def expired(self, now: float) -> str | None:
        config = self.config
        if self.inflight_since is not None:
            return "answer" if now - self.inflight_since > config.answer_timeout_s else None
        if self.pending_since is not None:
            return "request" if now - self.pending_since > config.request_timeout_s else None
        return "idle" if now - self.last_activity > config.idle_timeout_s else None


async def sweep(guards: dict, closed, every_s: float) -> None:
    """Every ``every_s``, abort the connections past a bound (counted in ``closed`` by
    reason: request, answer or idle)."""
    while True:
        await asyncio.sleep(every_s)
        now = time.monotonic()
        for transport, guard in list(guards.items()):
            why = guard.expired(now)
            if why is not None:
                closed.labels(why).inc()
                guards.pop(transport, None)
                transport.abort()
