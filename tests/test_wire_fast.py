"""serve's fast routes answered in C (`sarp._native.Conn`, serving/wire.c) against the
reference, `wire.Connection`, on real loopback sockets and uvloop: the same bytes for
the same request streams however they are cut, a connection handed to the reference
at the first request outside the subset with nothing lost or reordered, the time
bounds, and a client that does not read."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvloop

from sarp import native
from sarp.serving import wire

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"sarp._native {native.WHY}")


def answer(body: bytes, authorization: bytes | None) -> bytes | wire.Response:
    """The fast route's handler (and, wrapped, the reference's)."""
    if body == b"boom":
        raise RuntimeError("a bug")
    if body == b"refuse":
        return wire.Response(b'{"error":"no","field":"body"}', 400,
                             headers=((b"X-Why", b"test"),))
    if body == b"bye":
        return wire.Response(b'"bye"', close=True)
    if body.startswith(b"big"):
        return b'"' + b"x" * int(body[3:]) + b'"'
    return json.dumps({"body": body.decode("latin-1"),
                       "auth": authorization and authorization.decode()}).encode()


def as_response(got: bytes | wire.Response) -> wire.Response:
    return wire.Response(got) if isinstance(got, bytes) else got


@contextmanager
def serving(path: str, *, request_timeout_s: float = 5.0, idle_timeout_s: float = 5.0):
    """A wire.Server with fast routes on a free loopback port, taking its connections
    with ``wire.take`` on a uvloop thread, on the ``"c"`` or ``"python"`` path."""
    async def later(request):
        await asyncio.sleep(0.02)
        return wire.Response(b'"later:' + request.body + b'"')

    routes = {
        "/query": {"POST": lambda r: as_response(answer(r.body, r.headers.get(b"authorization")))},
        "/healthz": {"GET": lambda r: wire.Response(b'"alive"')},
        "/later": {"POST": later},
    }
    cuts: list[str] = []
    srv = wire.Server(routes, max_body_bytes=200_000, request_timeout_s=request_timeout_s,
                      answer_timeout_s=1.0, idle_timeout_s=idle_timeout_s, on_cut=cuts.append,
                      fast={"POST /query": answer, "GET /healthz": lambda b, a: b'"alive"'},
                      fast_body_bytes=100_000)
    srv.cuts = cuts
    loop = uvloop.new_event_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    srv.port = listener.getsockname()[1]

    def accept() -> None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wire.take(srv, loop, conn)

    async def main() -> None:
        loop.add_reader(listener.fileno(), accept)
        srv.sweeping = loop.create_task(srv.sweep(0.1))

    with native.forced(path):
        loop.run_until_complete(main())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield srv
        finally:
            loop.call_soon_threadsafe(srv.sweeping.cancel)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            for conn in list(srv.connections):
                conn.abort()
            listener.close()


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), extra, body))


def exchange(port: int, chunks: list[bytes], answers: int, timeout_s: float = 5.0) -> bytes:
    """Send ``chunks`` (each its own send, a pause between), then read until
    ``answers`` answers or the server closes: the raw bytes."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for chunk in chunks:
            s.sendall(chunk)
            time.sleep(0.002)
        return read(s, answers, timeout_s)


def read(s: socket.socket, answers: int, timeout_s: float) -> bytes:
    s.settimeout(timeout_s)
    data = b""
    while count(data) < answers:
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    return data


def count(data: bytes) -> int:
    """How many whole answers ``data`` holds."""
    n, at = 0, 0
    while (end := data.find(b"\r\n\r\n", at)) >= 0:
        head = data[at:end].decode("latin-1").lower()
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        if len(data) < end + 4 + length:
            break
        n, at = n + 1, end + 4 + length
    return n


def both(chunks: list[bytes], answers: int, **bounds) -> tuple[bytes, bytes, int]:
    """The bytes answered on the C path and on the reference's, and the requests C
    answered itself."""
    with serving("c", **bounds) as srv, native.Tally() as tally:
        in_c = exchange(srv.port, chunks, answers)
    with serving("python", **bounds) as srv:
        reference = exchange(srv.port, chunks, answers)
    return in_c, reference, tally.c("conn")


ROUTER = [post("/query", b"a"), post("/query", b"bb", b"Authorization: Bearer t\r\n"),
          b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n",
          post("/query", b"refuse"), post("/query", b"boom"), post("/query", b"big70000"),
          post("/query", b"", b"Content-Type: application/json\r\nAccept: */*\r\n")]


@pytest.mark.parametrize("cut", ["whole", "pipelined", "bytewise", "split-in-head"])
def test_routers_requests_get_the_reference_s_bytes_answered_in_c(cut):
    stream = b"".join(ROUTER)
    chunks = {"whole": ROUTER, "pipelined": [stream],
              "bytewise": [stream[i:i + 1] for i in range(len(stream))],
              "split-in-head": [stream[:20], stream[20:61], stream[61:]]}[cut]
    in_c, reference, answered_in_c = both(chunks, len(ROUTER))
    assert count(reference) == len(ROUTER)
    assert in_c == reference
    assert answered_in_c == len(ROUTER)
    assert b'"auth": "Bearer t"' in reference and b"HTTP/1.1 500 " in reference


def test_a_request_larger_than_an_idle_connection_s_buffer_is_answered_in_c():
    """Bodies of 20 KB and 99 KB (a connection keeps 16 KB while idle, and grows to
    take a request up to its bound), sent whole and in pieces, between small ones."""
    stream = (post("/query", b"a") + post("/query", b"x" * 20_000) + post("/query", b"b")
              + post("/query", b"y" * 99_000) + post("/query", b"c"))
    for chunks in ([stream], [stream[i:i + 7_000] for i in range(0, len(stream), 7_000)]):
        in_c, reference, answered_in_c = both(chunks, 5)
        assert in_c == reference and answered_in_c == 5 and count(reference) == 5


# Each request here leaves the subset: C answers what came before it, and the
# reference everything from it on, in order.
OUTSIDE = [
    b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz?x=1 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n",
    b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n",
    post("/later", b"1"),
    b"POST /query HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    post("/query", b"x", b"Expect: 100-continue\r\n"),
    post("/query", b"x", b"X-Folded: a\r\n b\r\n"),
    post("/query", b"x", b"Content-Length: 1\r\n"),
    post("/query", b"y" * 100_001),
    b"POST /query HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost : x\r\n\r\n",
    b"GET /healthz HTTP/1.1\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n" + b"X-Pad: " + b"p" * 9000 + b"\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(101)) + b"\r\n",
    b"NOT HTTP AT ALL\r\n\r\n",
]


@pytest.mark.parametrize("outside", OUTSIDE, ids=[repr(r[:30]) for r in OUTSIDE])
def test_a_request_outside_the_subset_hands_the_connection_over_with_nothing_lost(outside):
    first, after = post("/query", b"first"), post("/query", b"after")
    for chunks in ([first + outside + after], [first, outside, after]):
        in_c, reference, answered_in_c = both(chunks, 3, request_timeout_s=1.0)
        assert in_c == reference, (in_c[-300:], reference[-300:])
        assert answered_in_c == 1  # `first`; the rest was the reference's
        assert reference.startswith(b"HTTP/1.1 200 OK") and b'"first"' in reference


def test_an_answer_that_closes_is_read_by_the_client_then_the_connection_closes():
    chunks = [post("/query", b"a") + post("/query", b"bye") + post("/query", b"never")]
    in_c, reference, answered_in_c = both(chunks, 3)
    assert in_c == reference and answered_in_c == 2
    assert reference.count(b"HTTP/1.1 200 OK") == 2 and b"never" not in reference
    assert reference.endswith(b'"bye"') and b"Connection: close" in reference


@pytest.mark.parametrize("ask", [b"Connection: close\r\n", b"connection: CLOSE\r\n"])
@pytest.mark.parametrize("last", [b"a", b"refuse"])
def test_a_request_that_asks_to_close_is_answered_in_c_then_the_connection_closes(ask, last):
    """One-shot clients (urllib, probes): the answer says it closes, what follows it in
    the stream is never answered, and the client reads the answer, then the end."""
    chunks = [post("/query", b"first") + post("/query", last, ask) + post("/query", b"never")]
    in_c, reference, answered_in_c = both(chunks, 3)
    assert in_c == reference and answered_in_c == 2
    assert reference.count(b"HTTP/1.1 ") == 2 and b"never" not in reference
    assert reference.count(b"Connection: close") == 1


@pytest.mark.parametrize("path", ["c", "python"])
def test_after_an_answer_that_closes_what_the_client_sends_is_dropped_within_the_bound(path):
    """A client that reads the closing answer but keeps sending and never closes:
    its bytes are read and dropped (no reset before it has read the answer), and the
    request bound ends the connection."""
    with serving(path, request_timeout_s=0.4) as srv, \
            socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(post("/query", b"x", b"Connection: close\r\n"))
        got = read(s, 2, 5)  # the answer, then the server's end of sending
        assert count(got) == 1 and b"Connection: close" in got
        started, sent = time.monotonic(), 0
        while srv.connections and time.monotonic() - started < 3:
            s.sendall(post("/query", b"ignored"))  # read and dropped meanwhile
            sent += 1
            time.sleep(0.01)
        assert not srv.connections and srv.cuts == ["request"] and sent > 10
        assert 0.3 < time.monotonic() - started < 1.5


@pytest.mark.parametrize("path", ["c", "python"])
def test_the_request_and_idle_bounds_cut_a_c_connection(path):
    with serving(path, request_timeout_s=0.4, idle_timeout_s=0.8) as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as half, \
                socket.create_connection(("127.0.0.1", srv.port)) as idle:
            half.sendall(post("/query", b"abc")[:-1])  # its last byte never comes
            idle.sendall(post("/query", b"abc"))
            assert count(read(idle, 1, 5)) == 1
            started = time.monotonic()
            assert read(half, 1, 5) == b""  # closed, no answer
            assert read(idle, 1, 5) == b""
            took = time.monotonic() - started
        assert sorted(srv.cuts) == ["idle", "request"] and took < 3
        assert not srv.connections


def test_a_client_that_does_not_read_is_handed_to_the_reference_and_cut():
    """Pipelined requests for 90 KB answers, none read: C sends until the socket
    takes no more, then the reference holds the rest under its flow control, stops
    reading, and the answer bound cuts the connection."""
    with serving("c") as srv, native.Tally() as tally:
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        s.settimeout(0.5)
        sent, request = 0, post("/query", b"big90000", b"X-Pad: " + b"p" * 1000 + b"\r\n")
        highest = 0

        def held() -> int:
            return max([c.transport.get_write_buffer_size() for c in list(srv.connections)
                        if isinstance(c, wire.Connection)] + [highest])
        try:
            for _ in range(20_000):
                s.sendall(request)
                sent += 1
                highest = held()
        except (TimeoutError, OSError):
            pass  # the server stopped reading: our send buffer filled
        deadline = time.monotonic() + 10
        while srv.connections and time.monotonic() < deadline:
            highest = held()
            time.sleep(0.05)
        assert sent < 20_000 and not srv.connections and "answer" in srv.cuts
        assert 0 < highest < (MAX_BUFFERED := 4 << 20), (highest, MAX_BUFFERED)
        assert 0 < tally.c("conn") < sent and tally.python("conn") == 1
        s.close()


def test_a_c_connection_answers_many_clients_and_requests_exactly():
    with serving("c") as srv:
        def client(k: int, out: list) -> None:
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                for i in range(200):
                    s.sendall(post("/query", b"%d-%d" % (k, i)))
                    got = read(s, 1, 5)
                    out.append(json.loads(got.partition(b"\r\n\r\n")[2])["body"])
        results = [[] for _ in range(8)]
        threads = [threading.Thread(target=client, args=(k, results[k])) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == [[f"{k}-{i}" for i in range(200)] for k in range(8)]
