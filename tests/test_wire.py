"""serve's HTTP/1.1 (`sarp.serving.wire`) on real loopback sockets: pipelined answers in
order around work done later, refusals that the client reads (not a reset), errors
in the JSON shape with the connection going on, and a client that does not read
held to a bounded buffer."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from sarp.serving import wire


@pytest.fixture
def server():
    """A wire.Server on a free loopback port, its loop on a thread."""
    async def later(request):
        await asyncio.sleep(0.05)
        return wire.Response(b'"later:' + request.body + b'"')

    def boom(request):
        raise RuntimeError("a bug")

    routes = {
        "/now": {"POST": lambda r: wire.Response(b'"now:' + r.body + b'"'),
                 "GET": lambda r: wire.Response(b'"now"')},
        "/later": {"POST": later},
        "/boom": {"GET": boom},
        "/big": {"GET": lambda r: wire.Response(b"x" * (64 << 10), content_type=b"text/plain")},
    }
    srv = wire.Server(routes, max_body_bytes=1000, request_timeout_s=2.0,
                      answer_timeout_s=5.0, idle_timeout_s=5.0)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def main():
        holder["server"] = await loop.create_server(lambda: wire.Connection(srv), "127.0.0.1", 0)
        holder["sweep"] = loop.create_task(srv.sweep(0.2))
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(main()),
                                              loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10)
    srv.port = holder["server"].sockets[0].getsockname()[1]
    yield srv
    loop.call_soon_threadsafe(holder["sweep"].cancel)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), extra, body))


def read_answers(s: socket.socket, count: int, timeout_s: float = 5.0) -> list[tuple[int, bytes]]:
    """``count`` answers (status, body) from a keep-alive connection."""
    s.settimeout(timeout_s)
    data, out = b"", []
    while len(out) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].decode()
            length = int(next(ln.split(":")[1] for ln in head.split("\r\n")
                              if ln.lower().startswith("content-length")))
            if len(data) >= head_end + 4 + length:
                out.append((int(head.split()[1]), data[head_end + 4: head_end + 4 + length]))
                data = data[head_end + 4 + length:]
                continue
        chunk = s.recv(65536)
        if not chunk:
            raise AssertionError(f"closed after {len(out)} answers")
        data += chunk
    return out


def read_to_close(s: socket.socket, timeout_s: float = 5.0) -> bytes:
    s.settimeout(timeout_s)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_pipelined_answers_keep_their_order_around_work_done_later(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(post("/later", b"1") + post("/now", b"2") + post("/later", b"3")
                  + post("/now", b"4"))
        assert read_answers(s, 4) == [(200, b'"later:1"'), (200, b'"now:2"'),
                                      (200, b'"later:3"'), (200, b'"now:4"')]


def test_a_handler_error_is_a_json_500_and_the_connection_goes_on(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n" + post("/now", b"5"))
        (status, body), second = read_answers(s, 2)
        assert status == 500 and json.loads(body)["field"] == "server"
        assert second == (200, b'"now:5"')


@pytest.mark.parametrize("request_bytes, status, field", [
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404, "path"),
    (b"DELETE /now HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method"),
])
def test_unknown_paths_and_methods_are_refused_in_the_json_shape(server, request_bytes, status,
                                                                 field):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(request_bytes + post("/now", b"6"))
        (got, body), after = read_answers(s, 2)
        assert (got, json.loads(body)["field"]) == (status, field)
        assert after == (200, b'"now:6"')


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /now HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n",
     431),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"POST /now HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"".join(b"100\r\n" + b"z" * 256 + b"\r\n" for _ in range(8)) + b"0\r\n\r\n", 413),
    (b"POST /now HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + b"z" * 5000, 413),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
])
def test_a_refusal_is_read_by_the_client_then_the_connection_closes(server, request_bytes,
                                                                    status):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(request_bytes)
        answer = read_to_close(s)  # no reset: the client reads the answer, then EOF
    head, _, body = answer.partition(b"\r\n\r\n")
    assert int(head.split()[1]) == status, answer[:200]
    assert b"Connection: close" in head and json.loads(body)["error"]


def test_head_gets_the_headers_of_get_and_no_body(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"HEAD /now HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\n")
    assert b"Content-Length: 5\r\n" in answer


def test_a_client_that_does_not_read_holds_a_bounded_buffer_and_is_cut(server):
    """20,000 pipelined requests for 64 KiB answers (1.2 GiB), none read: the server
    stops reading the requests once its buffer is full, and the answer bound cuts the
    connection; its memory never held more than a few answers."""
    s = socket.create_connection(("127.0.0.1", server.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    s.settimeout(0.5)
    sent = 0
    request = b"GET /big HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 1000 + b"\r\n\r\n"
    highest = 0
    deadline = time.monotonic() + 15
    try:
        for _ in range(20_000):
            s.sendall(request)
            sent += 1
            for conn in list(server.connections):
                highest = max(highest, conn.transport.get_write_buffer_size())
    except (TimeoutError, OSError):
        pass  # the server stopped reading: our send buffer filled
    assert sent < 20_000
    while server.connections and time.monotonic() < deadline:
        for conn in list(server.connections):
            highest = max(highest, conn.transport.get_write_buffer_size())
        time.sleep(0.05)
    assert not server.connections  # cut by the answer bound
    assert highest < (MAX_BUFFERED := 4 << 20), (highest, MAX_BUFFERED)
    s.close()
