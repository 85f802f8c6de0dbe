"""The service benchmark's scoring (``benchmarks/service.py``): what counts as a rate
held.  Its measurements run against live services and are not tests; the rule that
turns a sweep into the figure the issue's target is held to is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("psutil")
_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "service.py"
_SPEC = importlib.util.spec_from_file_location("service_bench", _PATH)
service = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(service)


def point(offered: float, achieved: float, p99: float | None) -> dict:
    return {"offered_events_per_s": offered, "achieved_events_per_s": achieved,
            "lag_p99_ms": p99}


def test_a_rate_is_held_only_where_its_lag_stayed_low_and_the_engines_reached_it():
    sweep = [point(10_000, 9_998, 5.0), point(20_000, 19_990, 40.0),
             point(40_000, 39_900, 150.0),  # reached, lag too high
             point(80_000, 60_000, 50.0)]  # lag low, but the engines published 75%
    assert service.held(sweep) == 20_000
    assert service.held(sweep[:2] + [point(40_000, 38_100, 99.0)]) == 40_000  # 95.25%
    assert service.held([point(5_000, 5_000, None)]) == 0.0


def test_an_earlier_run_is_scored_again_by_the_rule():
    runs = {"sarp": [{"rate_held_events_per_s": 20_000.0,
                      "sweep": [point(10_000, 10_000, 5.0), point(20_000, 20_000, 80.0)]}],
            "dynamo": [{"rate_held_events_per_s": 160_000.0,
                        "sweep": [point(60_000, 59_900, 30.0),
                                  point(160_000, 70_000, 90.0)]}]}
    got = service.rescore({"runs": runs, "median": {}, "ratio": {}})
    assert [r["rate_held_events_per_s"] for r in got["runs"]["dynamo"]] == [60_000]
    assert got["median"]["rate_held_events_per_s"] == {"sarp": 20_000, "dynamo": 60_000}
    assert got["ratio"]["rate_held_events_per_s"] == pytest.approx(1 / 3)
