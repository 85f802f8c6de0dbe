"""Shared fixtures: where the real traces are, and whether they must be there."""

from __future__ import annotations

import os
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
