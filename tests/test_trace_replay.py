"""Replay of the real Mooncake conversation trace (match, then insert each request)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import sarp
from sarp.bench.traces import read_requests

pytestmark = pytest.mark.traces


@pytest.fixture(scope="module")
def replay(tmp_path_factory, request):
    from conftest import trace_path

    path = trace_path("mooncake_conversation.jsonl")
    requests = [r.hashes for r in read_requests(path)]
    held: set[int] = set()
    exact, got, reads = [], [], []
    folder = tmp_path_factory.mktemp("mooncake")
    with sarp.open(folder / "ix", durability="nosync") as index:
        for ids in requests:
            n_exact = 0
            for h in ids.tolist():
                if h not in held:
                    break
                n_exact += 1
            m = index.match(ids)
            assert m.num_blocks <= n_exact, "sarp reported a block that was never stored"
            exact.append(n_exact)
            got.append(m.num_blocks)
            reads.append(m.storage_reads)
            if m.num_blocks < ids.size:
                parent = int(ids[m.num_blocks - 1]) if m.num_blocks else None
                index.insert(ids[m.num_blocks :], parent=parent, holder="engine-0")
            held.update(ids.tolist())
        stats = index.stats()
        assert index.check() == []
    return {
        "requests": requests,
        "exact": np.array(exact),
        "got": np.array(got),
        "reads": np.array(reads),
        "stats": stats,
        "distinct": len(held),
    }


def test_reuse_loss_is_at_most_0_003_percent(replay):
    exact, got = int(replay["exact"].sum()), int(replay["got"].sum())
    assert exact > 100_000  # the trace's 36.6% reuse: the replay really reused blocks
    loss = (exact - got) / exact
    assert loss <= 0.00003, f"reuse loss {loss:.6%}: {exact - got} of {exact} blocks"


def test_directory_holds_far_fewer_entries_than_blocks(replay):
    stats = replay["stats"]
    assert stats["blocks"] == replay["distinct"] == 182_790
    ratio = stats["directory_entries"] / stats["blocks"]
    assert ratio < 0.1, f"{stats['directory_entries']} entries for {stats['blocks']} blocks"


def test_a_match_reads_about_matched_over_s_plus_a_few_segments(replay):
    S = replay["stats"]["segment_blocks"]
    got, reads = replay["got"], replay["reads"]
    floor = np.array([math.ceil(n / S) for n in got])
    extra = reads - floor
    # Each read verifies up to S blocks.  The extra reads are branch points: in this
    # trace a turn re-hashes the previous turn's last (partial) block, so every turn
    # branches one block before the previous turn's end and starts a segment there.
    assert extra.mean() <= 1.0 and np.percentile(extra, 99) <= 8, np.bincount(extra)
    assert reads.sum() <= got.sum() / 4  # a per-block index reads got.sum() + misses
    long = got >= 64  # requests reusing 64+ blocks (32k+ tokens): far from a read per block
    assert long.sum() > 100
    assert (reads[long] <= got[long] / 4).all(), (reads[long].max(), got[long].min())
