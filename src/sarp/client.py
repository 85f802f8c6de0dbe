"""Clients for ``sarp serve --http``: :class:`Client` (blocking) and
:class:`AsyncClient` (asyncio), with the same methods, one keep-alive connection each
(made again when the server has closed it), the standard library only.

An answer is the service's JSON as Python objects; a refusal raises
:class:`ServiceError` with the HTTP status, the field at fault and the service's
message.  ``/readyz`` answers either way (a dict whose ``ready`` says which).

For example (with a serve on port 8080)::

    with Client("http://127.0.0.1:8080") as c:
        c.register(7, "tcp://10.0.0.5:5557", model_name="llama", block_size=16)
        c.query(token_ids, "llama")["scores"]     # {'7': {'0': 32}}

Cost: one HTTP round trip per call, a JSON encode and decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import urllib.parse
from collections.abc import Callable
from typing import Any

from .errors import SarpError

DEFAULT_URL = "http://127.0.0.1:8080"


class ServiceError(SarpError):
    """The service refused a request: ``status`` (HTTP), ``field`` (what is wrong) and
    the service's message."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" + (f" (field {field})" if field else ""))
        self.status, self.field, self.message = status, field, message


def _drop_none(**fields: Any) -> dict:
    return {k: v for k, v in fields.items() if v is not None}


class _Calls:
    """Every endpoint, once; ``_call`` (sync or async) does the transport."""

    _call: Callable[..., Any]

    def match(self, block_hashes=None, *, token_ids=None, block_size: int | None = None,
              weights: dict[str, float] | None = None):
        """``POST /v1/match``: per instance, how much of the request's prefix it holds."""
        if (block_hashes is None) == (token_ids is None):
            raise ValueError("pass block_hashes or token_ids (one of them)")
        return self._call("POST", "/v1/match", _drop_none(
            block_hashes=None if block_hashes is None else [int(h) for h in block_hashes],
            token_ids=None if token_ids is None else [int(t) for t in token_ids],
            block_size=block_size, weights=weights))

    def match_many(self, chains, *, block_size: int | None = None,
                   weights: dict[str, float] | None = None):
        """``POST /v1/match`` with ``requests``: one answer per chain, in order."""
        body = _drop_none(requests=[[int(h) for h in c] for c in chains],
                          block_size=block_size, weights=weights)
        return self._call("POST", "/v1/match", body, pick=lambda a: a["results"])

    def query(self, token_ids, model_name: str, *, routing_group: str | None = None,
              lora_name: str | None = None):
        """``POST /query`` (RFC #1403): tokens cached per instance, rank and tier."""
        return self._call("POST", "/query", _drop_none(
            token_ids=[int(t) for t in token_ids], model_name=model_name,
            routing_group=routing_group, lora_name=lora_name))

    def query_by_hash(self, block_hashes, model_name: str, *,
                      routing_group: str | None = None):
        """``POST /query_by_hash`` (RFC #1403), with the RFC's per-block hashes."""
        return self._call("POST", "/query_by_hash", _drop_none(
            block_hashes=[int(h) for h in block_hashes], model_name=model_name,
            routing_group=routing_group))

    def register(self, instance_id: int | str, endpoint: str, *,
                 replay_endpoint: str | None = None, model_name: str | None = None,
                 block_size: int | None = None, dp_rank: int | None = None,
                 routing_group: str | None = None):
        """``POST /register``: follow an engine's events from now on."""
        return self._call("POST", "/register", _drop_none(
            instance_id=instance_id, endpoint=endpoint, replay_endpoint=replay_endpoint,
            model_name=model_name, block_size=block_size, dp_rank=dp_rank,
            routing_group=routing_group))

    def unregister(self, instance_id: int | str, *, dp_rank: int | None = None,
                   model_name: str | None = None):
        """``POST /unregister``: stop following an engine (its blocks are cleared)."""
        return self._call("POST", "/unregister", _drop_none(
            instance_id=instance_id, dp_rank=dp_rank, model_name=model_name))

    def workers(self):
        """``GET /workers``: the engines followed."""
        return self._call("GET", "/workers")

    def healthz(self):
        """``GET /healthz``: the worker that answered is alive."""
        return self._call("GET", "/healthz")

    def readyz(self):
        """``GET /readyz``: ``{"ready": bool, ...}`` (503 is an answer here, not an error)."""
        return self._call("GET", "/readyz", ok=(200, 503))

    def metrics(self):
        """``GET /metrics``: the Prometheus text."""
        return self._call("GET", "/metrics", text=True)

    def openapi(self):
        """``GET /openapi.json``: the service's OpenAPI document."""
        return self._call("GET", "/openapi.json")


class _Wire:
    """What both transports share: the URL, the headers, reading an answer."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None,
                 timeout_s: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url={url!r}; pass http://HOST:PORT (TLS is a proxy's job: "
                             "point the client at the proxy)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}; pass a number of seconds > 0")
        self.host, self.port = parts.hostname, parts.port or 80
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    @staticmethod
    def _answer(status: int, data: bytes, *, text: bool, ok: tuple[int, ...], pick):
        if status not in ok and not (200 <= status < 300 and ok == (200,)):
            try:
                body = json.loads(data)
                message, field = body.get("error", data.decode()), body.get("field")
            except (ValueError, AttributeError):
                message, field = data.decode(errors="replace"), None
            raise ServiceError(status, message, field)
        if text:
            return data.decode()
        got = json.loads(data)
        return pick(got) if pick else got


class Client(_Calls, _Wire):
    """A blocking client on one keep-alive connection (not thread-safe: one per thread).

    >>> Client("http://127.0.0.1:1", timeout_s=0.5).healthz()
    Traceback (most recent call last):
    ...
    ConnectionRefusedError: [Errno 111] Connection refused
    """

    _conn: http.client.HTTPConnection | None = None

    def _call(self, method: str, path: str, body: dict | None = None, *, text: bool = False,
              ok: tuple[int, ...] = (200,), pick=None):
        payload = None if body is None else json.dumps(body).encode()
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port,
                                                        timeout=self.timeout_s)
            try:
                self._conn.request(method, path, payload, self._headers)
                response = self._conn.getresponse()
                data = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()  # the server closed a kept-alive connection: once more
                if attempt:
                    raise
            except BaseException:
                self.close()
                raise
        if response.will_close:
            self.close()
        return self._answer(response.status, data, text=text, ok=ok, pick=pick)

    def close(self) -> None:
        """Close the connection (the next call makes a new one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


class AsyncClient(_Calls, _Wire):
    """An asyncio client on one keep-alive connection; its calls run one at a time
    (a lock), so one client may be shared by a loop's tasks.

    >>> async def main():
    ...     async with AsyncClient("http://127.0.0.1:8080") as c:
    ...         return await c.healthz()
    """

    _reader: asyncio.StreamReader | None = None
    _writer: asyncio.StreamWriter | None = None
    _lock: asyncio.Lock | None = None

    async def _call(self, method: str, path: str, body: dict | None = None, *,
                    text: bool = False, ok: tuple[int, ...] = (200,), pick=None):
        payload = b"" if body is None else json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in self._headers.items())
        request = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{head}"
                   f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            for attempt in (0, 1):
                fresh = self._writer is None
                try:
                    status, close, data = await asyncio.wait_for(
                        self._round_trip(request), self.timeout_s)
                    break
                except (ConnectionError, asyncio.IncompleteReadError):
                    await self.aclose()  # closed while kept alive: once more, on a new one
                    if attempt or fresh:
                        raise
                except BaseException:
                    await self.aclose()
                    raise
            if close:
                await self.aclose()
        return self._answer(status, data, text=text, ok=ok, pick=pick)

    async def _round_trip(self, request: bytes) -> tuple[int, bool, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(request)
        await self._writer.drain()
        status_line = await self._reader.readuntil(b"\r\n")
        status = int(status_line.split()[1])
        headers = {}
        while (line := await self._reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" not in headers:
            raise ConnectionError(f"the answer (HTTP {status}) has no Content-Length")
        data = await self._reader.readexactly(int(headers["content-length"]))
        return status, headers.get("connection", "").lower() == "close", data

    async def aclose(self) -> None:
        """Close the connection (the next call makes a new one)."""
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.aclose()
