"""serve's HTTP/1.1: an ``asyncio.Protocol`` on uvloop over ``httptools``' C parser,
with the time and size bounds a service open to any client needs.

Chosen by measurement (``benchmarks/http_stacks.py``, docs/performance.md): one
worker answered 101k ``/healthz`` a second on it, against 51k on granian and 24k on
aiohttp, and twice aiohttp's ``/query`` rate.  What a framework adds per request
(a request object with lazy properties, middleware chains, a response object that
writes its headers in several calls) was most of the time of a small match; here a
request is a handful of Python calls (the parser's callbacks) and one write.

What a connection gets:

* keep-alive and pipelining: answers go out in the order the requests came, one
  request handled at a time per connection; at most ``MAX_QUEUED`` parsed requests
  wait, then reading pauses (as it does while the client does not read its answers);
* bounds on size: the URL, the headers (count and bytes), and the body
  (``max_body_bytes``: a larger ``Content-Length`` is refused with 413 before a byte
  of the body is read, and the connection closes);
* bounds on time (:meth:`Connection.expired`, enforced by :meth:`Server.sweep`): a
  request's headers and body within ``request_timeout_s`` of its first byte, its
  answer within ``answer_timeout_s``, at most ``idle_timeout_s`` between requests;
* a handler is a function of a :class:`Request`, returning a :class:`Response` (or
  an awaitable of one, for work beside the event loop); an error becomes a JSON 500,
  logged, and the connection goes on.

Cost per request: the parser's C pass, about six Python callbacks, one dict lookup
for the route, and one ``transport.write``.

The routes a server names ``fast`` (``{"POST /query": handler(body, authorization)}``)
are answered in C while a connection's requests stay in a strict subset of HTTP/1.1
(``sarp._native.Conn``, ``serving/wire.c``; :func:`take`): one ``recv``, the request
framed and the handler called, its answer framed and sent, with no Python but the
handler's.  At the first request outside the subset, or an answer the socket does
not take at once, the connection and the bytes it holds go to :class:`Connection`,
the reference, for good.  This module is the only one that imports httptools and
uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus

import httptools

from .. import native

log = logging.getLogger("sarp.http")

MAX_URL_BYTES = 8 << 10
MAX_HEADER_BYTES = 64 << 10
MAX_HEADERS = 100
MAX_QUEUED = 16  # pipelined requests parsed ahead of their answers, then reading pauses
# After a refusal that closes, what the client still sends is read and dropped (up to
# this much, within the request bound) so that it reads the answer, not a reset.
MAX_LINGER_BYTES = 64 << 20


@dataclass(slots=True)
class Request:
    """One request: ``method`` and ``path`` as str, ``headers`` with lower-case names
    (bytes to bytes), the whole ``body``."""

    method: str
    path: str
    headers: dict[bytes, bytes]
    body: bytes


class Response:
    """An answer: status, body bytes, content type, more headers, and whether the
    connection closes after it."""

    __slots__ = ("status", "body", "content_type", "headers", "close")

    def __init__(self, body: bytes, status: int = 200, content_type: bytes = b"application/json",
                 headers: tuple[tuple[bytes, bytes], ...] = (), close: bool = False) -> None:
        self.status, self.body, self.content_type = status, body, content_type
        self.headers, self.close = headers, close


Handler = Callable[[Request], "Response | Awaitable[Response]"]


def error(status: int, field: str, message: str, **kwargs) -> Response:
    """Every refusal's shape: ``{"error": message, "field": field}``."""
    return Response(json.dumps({"error": message, "field": field}).encode(), status, **kwargs)


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class Server:
    """The routes and bounds that every connection of a worker shares.

    ``routes``: path -> {method: handler}; ``GET`` routes answer ``HEAD`` too.
    ``on_cut(reason)``: a connection closed for taking too long (request, answer or
    idle).  ``too_large(length)``: the refusal of a body over ``max_body_bytes``.
    ``fast``: ``"METHOD /path"`` -> ``handler(body, authorization)`` answering at once
    (200 JSON bytes, or a :class:`Response`), for bodies up to ``fast_body_bytes``: the
    same answers as ``routes`` give, answered in C when the extension is built (see the
    module docstring); ``authorization`` is the header's value, or None.  ``chores``:
    coroutine functions :func:`run` keeps running beside the connections.
    """

    def __init__(self, routes: dict[str, dict[str, Handler]], *, max_body_bytes: int,
                 request_timeout_s: float, answer_timeout_s: float, idle_timeout_s: float,
                 on_cut: Callable[[str], None] = lambda reason: None,
                 too_large: Callable[[int], Response] | None = None,
                 fast: dict[str, Callable[[bytes, bytes | None], bytes | Response]] | None = None,
                 fast_body_bytes: int = 64 << 10,
                 chores: Sequence[Callable[[], Awaitable]] = ()) -> None:
        self.routes = routes
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s, self.answer_timeout_s = request_timeout_s, answer_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.on_cut = on_cut
        self.too_large = too_large or (lambda length: error(
            413, "body", f"the body is over {max_body_bytes} bytes", close=True))
        self.connections: set = set()  # Connection, or sarp._native.Conn
        self._failures = 0
        self.fast = {key.encode(): self._caught(key, h) for key, h in (fast or {}).items()}
        self.fast_body_bytes = min(fast_body_bytes, max_body_bytes)
        self._adopting: set[asyncio.Task] = set()
        self.chores = list(chores)

    def _caught(self, key: str, handler: Callable) -> Callable:
        method, _, path = key.partition(" ")

        def call(body: bytes, authorization: bytes | None) -> bytes | Response:
            try:
                return handler(body, authorization)
            except Exception as exc:  # noqa: BLE001 - as handle: a 500, and the next request
                return self.failed(Request(method, path, {}, body), exc)
        return call

    def adopt(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, rest: bytes = b"",
              out: bytes = b"", linger: bool = False) -> None:
        """Serve ``sock`` with a :class:`Connection` (``out`` written first, then
        ``rest`` read as if it had just arrived, or closed after ``out`` with
        ``linger``)."""
        async def adopted() -> None:
            try:
                await loop.connect_accepted_socket(
                    lambda: Connection(self, rest, out, linger), sock)
            except OSError:  # the client left before we got to it
                sock.close()

        task = loop.create_task(adopted())
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)

    def handle(self, request: Request) -> Response | Awaitable[Response]:
        """The route's answer; 404 and 405 in the JSON shape; a handler's error 500."""
        route = self.routes.get(request.path)
        if route is None:
            return error(404, "path", f"Not Found: {request.method} {request.path}")
        handler = route.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            allow = ", ".join(sorted(route)).encode()
            return error(405, "method", f"Method Not Allowed: {request.method} {request.path}",
                         headers=((b"Allow", allow),))
        try:
            return handler(request)
        except Exception as exc:  # noqa: BLE001 - the service answers the next request
            return self.failed(request, exc)

    def failed(self, request: Request, exc: BaseException) -> Response:
        """A handler's error: logged (the first ten, then every hundredth), answered 500."""
        self._failures += 1
        if self._failures <= 10 or self._failures % 100 == 0:
            log.error("sarp: %s %s failed (%d so far): %r", request.method, request.path,
                      self._failures, exc, exc_info=exc)
        return error(500, "server", f"the request failed ({type(exc).__name__}); it was "
                                    "logged, please report it")

    async def sweep(self, every_s: float) -> None:
        """Every ``every_s``, abort the connections past a time bound."""
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for conn in list(self.connections):
                why = conn.expired(now)
                if why is not None:
                    self.connections.discard(conn)
                    self.on_cut(why)
                    conn.abort()


class _Refused(Exception):
    """Raised in a parser callback to stop the parse (the refusal is queued)."""


class Connection(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    __slots__ = ("server", "parser", "transport", "queue", "busy", "closing", "eof",
                 "pending_since", "inflight_since", "last_activity", "_url", "_headers",
                 "_header_bytes", "_body", "_size", "_paused", "_lingering", "_blocked",
                 "_taken")

    def __init__(self, server: Server, rest: bytes = b"", out: bytes = b"",
                 linger: bool = False) -> None:
        # (what a C connection handed over: its answers not yet sent, its bytes not yet
        # answered, and whether it was closing)
        self._taken = (rest, out, linger) if rest or out or linger else None
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None
        self.queue: deque = deque()  # (Request, keep_alive) or a refusal Response
        self.busy = self.closing = self.eof = self._paused = False
        self.pending_since: float | None = None  # first byte of a request not yet handled
        self.inflight_since: float | None = None  # a handler running since
        self.last_activity = time.monotonic()
        self._url, self._headers, self._header_bytes = b"", {}, 0
        self._body: list[bytes] = []
        self._size = 0
        self._lingering: int | None = None  # bytes dropped since the closing answer
        self._blocked = False  # the client is not reading: answers wait (pause_writing)

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        if self._taken is not None:
            rest, out, linger = self._taken
            self._taken = None
            if out:
                transport.write(out)  # may call pause_writing
            if linger:
                self.closing = True
                self._linger()
            elif rest:
                self.data_received(rest)
            if self._paused:  # the transport starts reading once this returns: pause again
                asyncio.get_running_loop().call_soon(self._pause_again)

    def _pause_again(self) -> None:
        if self._paused and not self.transport.is_closing():
            self.transport.pause_reading()

    def abort(self) -> None:
        """Close now, dropping what waits to be sent (the sweep's cut)."""
        self.transport.abort()

    def close(self) -> None:
        """Close once what waits is sent (the worker's stop)."""
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.closing = True

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            self._lingering += len(data)
            if self._lingering > MAX_LINGER_BYTES:
                self.transport.abort()
            return
        if self.closing:
            return
        now = time.monotonic()
        self.last_activity = now
        if self.pending_since is None and self.inflight_since is None:
            self.pending_since = now
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserCallbackError, _Refused):
            pass  # a bound was crossed: the refusal is queued
        except httptools.HttpParserUpgrade:
            self.queue.append(error(400, "request", "upgrades are not served", close=True))
        except httptools.HttpParserError as exc:
            self.queue.append(error(400, "request", f"not an HTTP/1.1 request ({exc})",
                                    close=True))
        if self.queue and isinstance(self.queue[-1], Response):
            self.closing = True  # nothing after a refusal is read
            self.transport.pause_reading()
        self._dispatch()

    def eof_received(self) -> bool:
        self.eof = True
        if self._lingering is not None:
            return False
        return bool(self.queue) or self.busy  # keep the transport open to answer them

    def pause_writing(self) -> None:
        """The client is not reading its answers: read no more requests, write no more
        answers, and the answer bound runs."""
        self._blocked = True
        self.inflight_since = self.inflight_since or time.monotonic()
        self._pause()

    def resume_writing(self) -> None:
        self._blocked = False
        self._dispatch()

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._header_bytes = b"", {}, 0
        self._body, self._size = [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL_BYTES:
            self._refuse(error(414, "path", f"the URL is over {MAX_URL_BYTES} bytes",
                               close=True))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES or len(self._headers) >= MAX_HEADERS:
            self._refuse(error(431, "headers", f"send at most {MAX_HEADERS} headers and "
                                               f"{MAX_HEADER_BYTES} bytes of them",
                               close=True))
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            self._refuse(self.server.too_large(int(length)))

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.max_body_bytes:  # chunked, past the bound
            self._refuse(self.server.too_large(self._size))
        self._body.append(body)

    def on_message_complete(self) -> None:
        path = self._url.partition(b"?")[0].decode("latin-1")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(self.parser.get_method().decode(), path, self._headers, body)
        self.queue.append((request, self.parser.should_keep_alive()))
        if len(self.queue) >= MAX_QUEUED:
            self._pause()

    def _refuse(self, response: Response) -> None:
        self.queue.append(response)
        raise _Refused

    # -- answering ----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Handle the queued requests in order, until one answers later (awaitable)."""
        while self.queue and not self.busy and not self._blocked \
                and not self.transport.is_closing():
            item = self.queue.popleft()
            if isinstance(item, Response):
                self._write(item, False, "")
                return
            request, keep = item
            self.pending_since, self.inflight_since = None, time.monotonic()
            out = self.server.handle(request)
            if isinstance(out, Response):
                self._write(out, keep, request.method)
                continue
            self.busy = True
            task = asyncio.ensure_future(out)
            task.add_done_callback(lambda t, r=request, k=keep: self._answered(t, r, k))
            return
        if not self.queue and not self.busy and not self._blocked:
            if self.eof:
                self.transport.close()
            elif not self.closing:
                self._resume()

    def _answered(self, task: asyncio.Future, request: Request, keep: bool) -> None:
        self.busy = False
        if self.transport.is_closing():
            return
        try:
            response = task.result()
        except Exception as exc:  # noqa: BLE001
            response = self.server.failed(request, exc)
        self._write(response, keep, request.method)
        self._dispatch()

    def _write(self, response: Response, keep: bool, method: str) -> None:
        close = response.close or not keep
        self.transport.write(frame(response, close, method))  # may call pause_writing
        if not self._blocked:
            self.inflight_since = None
        self.last_activity = time.monotonic()
        if close:
            self.closing = True
            self._linger()

    def _linger(self) -> None:
        """Close after the answer: our side at once (FIN), theirs when the client has
        read it and closes, its further bytes dropped meanwhile (closing with them
        unread would reset the connection before the client reads the answer).  The
        request bound cuts a client that never closes."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._lingering = 0
        self.pending_since = self.pending_since or time.monotonic()
        self._paused = True  # so that _resume reads again
        self._resume()

    def _pause(self) -> None:
        if not self._paused and not self.transport.is_closing():
            self._paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._paused and not self.transport.is_closing():
            self._paused = False
            self.transport.resume_reading()

    def expired(self, now: float) -> str | None:
        """Which time bound the connection is past, if any."""
        server = self.server
        if self.inflight_since is not None:
            return "answer" if now - self.inflight_since > server.answer_timeout_s else None
        if self.pending_since is not None:
            return "request" if now - self.pending_since > server.request_timeout_s else None
        return "idle" if now - self.last_activity > server.idle_timeout_s else None


def frame(response: Response, close: bool = False, method: str = "GET") -> bytes:
    r"""The bytes of an answer: status line, headers, body (none to a ``HEAD``); what
    ``serving/wire.c`` writes for a handler's 200 bytes too.

    >>> frame(Response(b'{}'))
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}'
    """
    head = [b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
            % (response.status, _REASONS.get(response.status, b"-"), response.content_type,
               len(response.body))]
    head += [b"%s: %s\r\n" % pair for pair in response.headers]
    if close:
        head.append(b"Connection: close\r\n")
    head.append(b"\r\n")
    if method != "HEAD":
        head.append(response.body)
    return b"".join(head)


def take(server: Server, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Serve an accepted connection: in C (``sarp._native.Conn``) when the server has
    fast routes and the extension is built, else, or once C hands it over, with a
    :class:`Connection`.  Cost: one object and one reader on the loop."""
    c = native.C
    if c is None or not server.fast:
        native.ran_python("conn")
        server.adopt(loop, sock)
        return
    sock.setblocking(False)
    fd = sock.detach()
    try:
        conn = c.Conn(fd, server.fast, _Side(server, loop), server.request_timeout_s,
                      server.idle_timeout_s, server.fast_body_bytes)
    except BaseException:
        os.close(fd)
        raise
    server.connections.add(conn)
    loop.add_reader(fd, conn.readable)


class _Side:
    """What a C connection calls back (``serving/wire.c``): ``release`` before its
    descriptor is closed or handed over, ``hand_over`` to a :class:`Connection`, and
    ``frame`` for an answer that is not plain 200 JSON."""

    __slots__ = ("server", "loop")

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop

    def release(self, conn, fd: int) -> None:
        self.loop.remove_reader(fd)
        self.server.connections.discard(conn)

    def hand_over(self, fd: int, rest: bytes, out: bytes, linger: bool) -> None:
        native.ran_python("conn")
        self.server.adopt(self.loop, socket.socket(fileno=fd), rest, out, linger)

    @staticmethod
    def frame(response: Response, close: bool = False) -> tuple[bytes, bool]:
        close = close or response.close
        return frame(response, close), close


class Beside:
    """Work run on one thread of its own beside the event loop, its answer handed back
    as an asyncio future (what :meth:`Connection._dispatch` waits on): per call a queue
    put and one ``call_soon_threadsafe``, where an executor behind a coroutine made a
    task, two futures chained and their callbacks.  One thread, so a burst of such
    work queues instead of crowding the core; started at the first call (a worker's,
    after the fork).

    >>> import asyncio
    >>> beside = Beside("doc")
    >>> async def main():
    ...     return await beside(sum, [1, 2, 3])
    >>> asyncio.run(main())
    6
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def __call__(self, work: Callable, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((loop, future, work, args))
        return future

    def _run(self) -> None:
        while True:
            loop, future, work, args = self._queue.get()
            try:
                result, error = work(*args), None
            except BaseException as exc:  # noqa: BLE001 - the awaiting side raises it
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def import_loop() -> None:
    """Import uvloop now (the HTTP zygote's, before it forks the workers)."""
    import uvloop  # noqa: F401


def run(server: Server, channel: socket.socket, chores: list[Callable[[], Awaitable]],
        signals: bool = True) -> None:
    """Serve the connections that serve's dealer passes over ``channel`` (file
    descriptors, ``SCM_RIGHTS``) on uvloop, with ``chores`` (coroutine functions)
    beside; until serve closes its end, or (``signals``: a worker process's main
    thread) SIGTERM or SIGINT."""
    import uvloop

    uvloop.run(_serve_dealt(server, channel, chores, signals))


async def _serve_dealt(server: Server, channel: socket.socket,
                       chores: list[Callable[[], Awaitable]], signals: bool) -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT) if signals else ():
        loop.add_signal_handler(signum, done.set)
    every_s = min(1.0, server.request_timeout_s / 4, server.idle_timeout_s / 4)
    tasks = [loop.create_task(server.sweep(every_s))] + [
        loop.create_task(c()) for c in [*chores, *server.chores]]

    def dealt() -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(channel, 64, 64)
            except BlockingIOError:
                return
            except OSError:
                msg, fds = b"", []
            if not msg and not fds:  # serve closed its end: it is stopping, or gone
                done.set()
                loop.remove_reader(channel.fileno())
                return
            for fd in fds:
                take(server, loop, socket.socket(fileno=fd))

    channel.setblocking(False)
    loop.add_reader(channel.fileno(), dealt)
    try:
        await done.wait()
    finally:
        for task in tasks:
            task.cancel()
        loop.remove_reader(channel.fileno())
        channel.close()
        deadline = time.monotonic() + 1.0  # answers in flight get a second
        while any(c.busy for c in server.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(server.connections):
            conn.close()
