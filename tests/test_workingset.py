"""Working-set analyzer: the one-pass curve equals a direct LRU simulation, to the block."""

from __future__ import annotations

import numpy as np
import pytest

from sarp.bench.traces import read_requests
from sarp.bench.workload import builtin
from sarp.workingset import WorkingSet, analyze
from sarp.workingset import simulate_lru as simulate


def capacities(curve, count: int = 10) -> list[int]:
    points = [p["capacity_blocks"] for p in curve.points()]
    picks = {points[int(i)] for i in np.linspace(0, len(points) - 1, count)}
    picks |= {max(p - 1, 1) for p in list(picks)[:3]}  # just below a change point too
    return sorted(picks)


def assert_exact(requests):
    curve = analyze(requests)
    accesses = sum(len(r) for r in requests)
    assert curve.accesses == accesses
    caps = capacities(curve)
    assert len(caps) >= 8
    for c in caps:
        assert round(curve.hit_rate(c) * accesses) == simulate(requests, c), c
    assert round(curve.unbounded_hit_rate * accesses) == simulate(requests, 10**9)


def test_curve_equals_simulation_on_a_branching_workload():
    requests = [r.hashes for r in builtin(seed=2, chat_sessions=60, agent_sessions=3)]
    assert_exact(requests)


def test_curve_equals_simulation_without_chained_hashes():
    # Random chains over a small alphabet: depths are not monotone along a request,
    # so the running maximum is what makes this exact.
    rng = np.random.default_rng(7)
    requests = [rng.choice(40, size=rng.integers(1, 12), replace=False) for _ in range(400)]
    assert_exact(requests)


@pytest.mark.traces
def test_curve_equals_simulation_on_the_mooncake_trace(mooncake):
    assert_exact([r.hashes for r in read_requests(mooncake)])


@pytest.mark.traces
def test_curve_equals_simulation_on_the_agentic_trace(weka):
    assert_exact([r.hashes for r in read_requests(weka, limit=150)])


def test_targets_give_the_smallest_capacity():
    requests = [r.hashes for r in builtin(seed=4, chat_sessions=40, agent_sessions=2)]
    curve = analyze(requests)
    target = 0.9 * curve.unbounded_hit_rate
    c = curve.capacity_for(target)
    assert curve.hit_rate(c) >= target > curve.hit_rate(c - 1)
    assert curve.capacity_for(1.0) is None or curve.unbounded_hit_rate == 1.0
    with pytest.raises(ValueError, match="fraction"):
        curve.capacity_for(1.5)


def test_online_exact_mode_matches_the_offline_pass():
    requests = [r.hashes for r in builtin(seed=5, chat_sessions=30, agent_sessions=2)]
    ws = WorkingSet()
    for r in requests:
        ws.observe(r)
    offline, online = analyze(requests), ws.curve()
    for c in capacities(offline):
        assert online.hit_rate(c) == pytest.approx(offline.hit_rate(c), abs=1e-12)


def sampled_error(requests, **kwargs) -> tuple[float, WorkingSet]:
    exact = analyze(requests)
    ws = WorkingSet(**kwargs)
    for r in requests:
        ws.observe(r)
    approx = ws.curve()
    # Both curves are step functions of the capacity: compare them at every capacity.
    size = max(exact.needed.size, approx.needed.size)
    rates = []
    for curve in (exact, approx):
        cum = np.cumsum(np.pad(curve.needed, (0, size - curve.needed.size))) / curve.accesses
        rates.append(cum)
    return float(np.abs(rates[0] - rates[1]).max()), ws


@pytest.mark.traces
def test_sampling_stays_within_0_01_on_mooncake(mooncake):
    requests = [r.hashes for r in read_requests(mooncake)]
    error, _ = sampled_error(requests, sample_rate=0.1)
    assert error <= 0.01, error


@pytest.mark.traces
def test_fixed_sample_size_bounds_memory_and_stays_within_0_01(weka):
    requests = [r.hashes for r in read_requests(weka, limit=1500)]
    error, ws = sampled_error(requests, sample_size=20_000)
    assert error <= 0.01, error
    assert len(ws._last) <= 20_000
    assert ws.sample_rate < 1.0  # the cap really lowered the rate


def test_online_analyzer_attached_to_an_index_sees_every_match(tmp_path):
    import sarp

    requests = [r.hashes for r in builtin(seed=6, chat_sessions=25, agent_sessions=1)]
    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        ws = WorkingSet().attach(index)
        for chain in requests:
            n = index.match(chain).num_blocks
            if n < chain.size:
                index.insert(chain[n:], parent=int(chain[n - 1]) if n else None, holder="e")
    offline = analyze(requests)
    for c in capacities(offline):
        assert ws.curve().hit_rate(c) == pytest.approx(offline.hit_rate(c), abs=1e-12)
    with sarp.open(tmp_path / "other") as index, pytest.raises(TypeError):
        index.observe_matches(42)


def test_workingset_command_writes_the_fields_the_issue_asks_for(tmp_path):
    import json
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    rows = [r.hashes.tolist() for r in builtin(seed=8, chat_sessions=20, agent_sessions=1)]
    trace.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in rows))
    out = tmp_path / "ws.json"
    subprocess.run(
        [sys.executable, "-m", "sarp.cli", "workingset", "--trace", str(trace), "--target", "0.9",
         "--target-abs", "0.2", "--block-tokens", "16", "--bytes-per-block", "1024",
         "--json", str(out), "--plot", str(tmp_path / "ws.png")],
        check=True, capture_output=True,
    )
    result = json.loads(out.read_text())
    exact = analyze([np.array(r, np.uint64) for r in rows])
    assert result["requests"] == len(rows)
    assert result["accesses"] == sum(map(len, rows))
    assert result["unbounded_hit_rate"] == pytest.approx(exact.unbounded_hit_rate)
    for point in result["curve"]:
        assert point["hit_rate"] == pytest.approx(exact.hit_rate(point["capacity_blocks"]))
        assert point["capacity_tokens"] == 16 * point["capacity_blocks"]
        assert point["capacity_bytes"] == 1024 * point["capacity_blocks"]
    by_kind = {t["kind"]: t for t in result["targets"]}
    assert by_kind["fraction_of_unbounded"]["capacity_blocks"] == exact.capacity_for(
        0.9 * exact.unbounded_hit_rate)
    assert by_kind["absolute"]["capacity_blocks"] == exact.capacity_for(0.2)
    assert (tmp_path / "ws.png").stat().st_size > 10_000


def test_dense_ids_group_equal_values_whatever_their_spread():
    from sarp.workingset.analyzer import _dense_ids

    rng = np.random.default_rng(3)
    for distinct in (rng.integers(0, 50, 20, dtype=np.int64).astype(np.uint64),
                     rng.integers(0, 2**63, 5000, dtype=np.int64).astype(np.uint64) * 2 + 1,
                     np.array([0, 2**64 - 1, 12345], np.uint64)):
        values = distinct[rng.integers(0, distinct.size, 20_000)]
        ids = _dense_ids(values)
        _, expected = np.unique(values, return_inverse=True)
        assert ids.min() == 0 and ids.max() == np.unique(values).size - 1
        # Same value <-> same id: the two labelings are the same partition.
        pairs = np.unique(np.stack([ids.astype(np.int64), expected]), axis=1)
        assert pairs.shape[1] == np.unique(values).size


def test_curve_equals_simulation_with_well_spread_hashes():
    mix = np.uint64(0x9E3779B97F4A7C15)
    requests = [(r.hashes * mix) ^ np.uint64(7)
                for r in builtin(seed=12, chat_sessions=50, agent_sessions=2)]
    assert_exact(requests)
