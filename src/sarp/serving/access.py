"""Who may ask the HTTP service: its address checked, and a bearer token required when
it binds beyond loopback (unless the operator says a proxy in front checks callers).
TLS is the fronting proxy's job (docs/design.md, "Faults").
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

log = logging.getLogger("sarp.http")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port).

    >>> parse_address("127.0.0.1:8080"), parse_address("[::1]:8080")
    (('127.0.0.1', 8080), ('::1', 8080))
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--http {text!r}: write HOST:PORT, e.g. 127.0.0.1:8080 "
                         "or [::1]:8080")
    return host.removeprefix("[").removesuffix("]"), int(port)


def access_token(address: str, token_file: str | None,
                 allow_unauthenticated: bool = False) -> str | None:
    """The bearer token in ``token_file`` (None without one); refuses to serve
    ``address`` beyond loopback without a token unless ``allow_unauthenticated``.

    >>> access_token("127.0.0.1:8080", None) is None
    True
    """
    token = None
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--http-token-file {token_file}: cannot read it "
                             f"({exc.strerror}); give a readable file holding the token") from None
        if not token or any(c.isspace() for c in token):
            raise ValueError(f"--http-token-file {token_file}: write one token (no spaces) "
                             "in it, e.g. the output of: openssl rand -hex 32")
    if token is None and not is_loopback(parse_address(address)[0]):
        if not allow_unauthenticated:
            raise ValueError(
                f"--http {address}: this binds beyond loopback, where anyone who can reach "
                "the port could read the index and /metrics; pass --http-token-file FILE "
                "(clients send 'Authorization: Bearer TOKEN'), or "
                "--http-allow-unauthenticated behind a proxy that checks callers")
        log.warning("sarp: serving HTTP on %s without authentication "
                    "(--http-allow-unauthenticated)", address)
    return token


def is_loopback(host: str) -> bool:
    """Does ``host`` name only loopback addresses?

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("0.0.0.0")
    (True, True, False)
    """
    import ipaddress

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)
