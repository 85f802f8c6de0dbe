"""The benchmark's own correctness on small inputs: exact answers, counters, trace
reading, split ids, and the JSON shape the issue asks for (no timings asserted)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from sarp import bench
from sarp.bench.baselines import opener
from sarp.bench.traces import Request, read_requests, split_blocks
from sarp.bench.workload import builtin


def test_trace_reading_handles_jsonl_gz_extra_fields_and_split(tmp_path):
    rows = [{"hash_ids": [1, 2, 3], "session_id": "s1", "agent": "main", "timestamp": 0},
            {"hash_ids": [1, 2, 4], "timestamp": 5}]
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    packed = tmp_path / "t.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write(plain.read_text())
    for path in (plain, packed):
        reqs = list(read_requests(path))
        assert [r.hashes.tolist() for r in reqs] == [[1, 2, 3], [1, 2, 4]]
        assert reqs[0].session_id == "s1" and reqs[1].session_id is None
    split = list(read_requests(plain, split=4, limit=1))
    assert len(split) == 1 and split[0].hashes.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                            14, 15]
    (tmp_path / "bad.jsonl").write_text('{"ids": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(read_requests(tmp_path / "bad.jsonl"))


def test_split_ids_stay_chained_and_distinct():
    a = split_blocks(np.array([10, 11], np.uint64), 4)
    b = split_blocks(np.array([10, 12], np.uint64), 4)
    assert a[:4].tolist() == b[:4].tolist()  # shared block -> shared sub-blocks
    assert not set(a[4:].tolist()) & set(b[4:].tolist())
    assert np.unique(a).size == a.size


@pytest.mark.parametrize("name", ["sarp", "memory-dict", "memory-radix", "lmdb-per-block",
                                  "rocksdb-per-block"])
def test_every_index_gives_the_exact_answer_and_survives_reopen(tmp_path, name):
    requests = builtin(seed=3, chat_sessions=30, agent_sessions=2)
    exact = opener("exact")()
    index = opener(name)(tmp_path / name, durability="nosync")
    for req in requests:
        want = exact.match(req.hashes).num_blocks
        got = index.match(req.hashes)
        assert got.num_blocks == want
        if name.endswith("per-block"):  # probes block by block: matched + the miss
            assert got.storage_reads == min(want + 1, req.hashes.size)
        n = want
        if n < req.hashes.size:
            parent = int(req.hashes[n - 1]) if n else None
            index.insert(req.hashes[n:], parent=parent, holder="e")
            exact.insert(req.hashes[n:], parent=parent, holder="e")
    index.close()
    index = opener(name)(tmp_path / name, durability="nosync")
    for req in requests[:50]:
        assert index.match(req.hashes).num_blocks == exact.match(req.hashes).num_blocks
    index.close()


def test_bench_run_reports_every_field(tmp_path):
    requests: list[Request] = builtin(seed=5, chat_sessions=20, agent_sessions=1)
    result = bench.run(requests, label="tiny", indexes=["sarp", "memory-dict", "lmdb-per-block"],
                       workdir=tmp_path, options={"durability": "nosync"}, progress=False,
                       passes=2, pass_s=0.05)
    for key in ("trace", "requests", "blocks", "distinct_blocks", "exact_reused_blocks"):
        assert key in result
    assert result["blocks"] == sum(r.hashes.size for r in requests)
    for name, r in result["indexes"].items():
        for key in ("reused_blocks", "match_requests_per_s", "insert_requests_per_s",
                    "storage_reads_per_request", "memory_bytes", "disk_bytes", "recovery_s",
                    "cold_match_requests_per_s", "batch_match_requests_per_s"):
            assert key in r, (name, key)
        for key in ("match_requests_per_s", "batch_match_requests_per_s",
                    "cold_match_requests_per_s", "recovery_s"):
            s = r["spread"][key]
            assert len(s["passes"]) == 2 and s["min"] <= s["median"] <= s["max"]
            assert s["median"] == r[key]
        assert r["reused_blocks"] == result["exact_reused_blocks"]
        assert r["false_positive_requests"] == 0
    assert result["indexes"]["memory-dict"]["storage_reads_per_request"] == 0
    assert result["indexes"]["sarp"]["storage_reads_per_request"] < result["indexes"][
        "lmdb-per-block"]["storage_reads_per_request"]
    assert set(result["ratios"]) == {"memory-dict", "lmdb-per-block"}
    for kinds in result["ratios"].values():
        assert set(kinds) == {"warm", "cold", "batch", "sarp_batch_vs_warm"}
        assert all(x["median"] > 0 and len(x["passes"]) == 2 for x in kinds.values())
    bench.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
    assert "sarp" in bench.table(result)


def test_mixed_ids_keep_the_trace_structure(tmp_path):
    rows = [[1, 2, 3], [1, 2, 4], [5]]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"hash_ids": r}) + "\n" for r in rows))
    _, plain = bench.load_requests(str(trace), 1, None)
    label, mixed = bench.load_requests(str(trace), 1, None, mix_ids=True)
    assert label.endswith("--mix-ids")
    assert mixed[0].hashes[:2].tolist() == mixed[1].hashes[:2].tolist()  # shared prefix
    assert mixed[0].hashes[2] != mixed[1].hashes[2]
    assert not set(mixed[0].hashes.tolist()) & {1, 2, 3}  # spread, not the raw ids


def test_the_sarp_bench_command_runs_end_to_end(tmp_path):
    # `make bench` runs this command; it must keep working whatever moves inside sarp.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sarp.cli", "bench", "--limit-requests", "40",
                          "--indexes", "sarp,memory-dict", "--durability", "nosync",
                          "--passes", "2", "--pass-s", "0.05",
                          "--workdir", str(tmp_path), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "memory-dict" in out.stdout and (tmp_path / "r.json").exists()
