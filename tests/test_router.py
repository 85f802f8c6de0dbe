import numpy as np
import pytest

import sarp
from sarp.serving.router import score, score_many, score_match


@pytest.fixture
def index(tmp_path):
    with sarp.open(tmp_path / "ix", durability="nosync", segment_blocks=4) as ix:
        yield ix


def test_tiers_split_within_one_instance_are_counted_per_block(index):
    chain = list(range(100, 110))
    index.insert(chain[:4], holder="w0", medium="GPU")  # offloaded: GPU has the head,
    index.insert(chain[4:], parent=chain[3], holder="w0", medium="CPU")  # CPU the rest
    index.insert(chain[:2], holder="w0", medium="CPU")  # and a copy of two GPU blocks
    index.insert(chain[:6], holder="w1#2", medium="DISK")
    best, second = score(index, chain + [999], block_size=16)
    assert best.instance == "w0" and best.engine == "w0" and best.dp_rank is None
    assert best.matched_blocks == 10 and best.matched_tokens == 160
    assert best.by_medium == {"GPU": 4, "CPU": 6}  # blocks 0-1 count once, at GPU
    assert best.score == pytest.approx(4 * 1.0 + 6 * 0.8)
    assert (second.instance, second.engine, second.dp_rank) == ("w1#2", "w1", 2)
    assert second.by_medium == {"DISK": 6} and second.score == pytest.approx(3.0)


def test_score_many_equals_score_match_request_by_request(index):
    chain = list(range(100, 110))
    index.insert(chain[:4], holder="w0", medium="GPU")
    index.insert(chain[4:], parent=chain[3], holder="w0", medium="CPU")
    index.insert(chain[:6], holder="w1#2", medium="DISK")
    index.insert([7, 8, 9], holder="w1#2", medium="GPU")
    chains = [chain + [999], chain[:3], [7, 8], [5], chain[:5] + [1]]
    weights = {"GPU": 1.0, "CPU": 0.5, "DISK": 0.25}
    many = score_many(index, chains, block_size=16, weights=weights)
    for c, (m, scores) in zip(chains, many, strict=True):
        one_m, one_scores = score_match(index, c, block_size=16, weights=weights)
        assert (m.num_blocks, scores) == (one_m.num_blocks, one_scores)
    assert [len(s) for _, s in many] == [2, 2, 1, 0, 2]


def test_presence_per_block_matches_the_holders(index):
    index.insert([1, 2, 3, 4, 5], holder="a", medium="GPU")
    index.insert([1, 2, 3], holder="b", medium="GPU")
    index.remove([2], holder="b", medium="GPU")
    m = index.match([1, 2, 3, 4, 5], with_presence=True)
    assert m.presence[("a", "GPU")].tolist() == [True] * 5
    assert m.presence[("b", "GPU")].tolist() == [True, False, True, False, False]
    assert index.match([1, 2]).presence == {}


def test_custom_weights_and_token_ids(index):
    tokens = list(range(64))
    index.insert(sarp.hash_blocks(tokens, 16), holder="e", medium="EXTERNAL")
    (only,) = score(index, token_ids=tokens, block_size=16, weights={"EXTERNAL": 0.25})
    assert only.matched_blocks == 4 and only.score == pytest.approx(1.0)
    (default,) = score(index, token_ids=tokens, block_size=16)
    assert default.score == pytest.approx(4 * 0.3)  # a medium with no weight given
    with pytest.raises(ValueError, match="block_size"):
        score(index, token_ids=tokens)
    (custom,) = score(index, token_ids=tokens, block_size=16, unknown_weight=0.1)
    assert custom.score == pytest.approx(0.4)
    for bad in (-1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="weight"):
            score(index, [1], weights={"GPU": bad})
    with pytest.raises(ValueError, match="block_size"):
        score(index, [1], block_size=-16)
    assert score(index, np.array([12345], np.uint64)) == []


def test_engine_media_aliases_weigh_as_their_tier(index):
    # SGLang's host tier is CPU_PINNED, LMCache's "cpu", vLLM 0.33's disk tier STORAGE.
    index.insert([1, 2], holder="sglang#0", medium="CPU_PINNED")
    index.insert([1, 2], holder="vllm#0", medium="CPU")
    index.insert([1, 2], holder="lmcache", medium="cpu")
    index.insert([1, 2], holder="offload#0", medium="STORAGE")
    scores = {s.instance: s.score for s in score(index, [1, 2])}
    assert scores == {"sglang#0": 1.6, "vllm#0": 1.6, "lmcache": 1.6, "offload#0": 1.0}
    (only,) = [s for s in score(index, [1, 2], weights={"cpu_pinned": 0.9, "GPU": 1.0})
               if s.instance == "sglang#0"]
    assert only.score == pytest.approx(1.8)


def test_token_ids_are_hashed_in_the_engines_scheme(index):
    tokens = list(range(1000, 1064))
    hashes = sarp.hash_blocks(tokens, 16, scheme="vllm-sha256-cbor", seed="42")
    index.insert(hashes, holder="vllm#0", medium="GPU")
    (only,) = score(index, token_ids=tokens, block_size=16, scheme="vllm-sha256-cbor",
                    seed="42")
    assert only.matched_blocks == 4 and only.matched_tokens == 64
    assert score(index, token_ids=tokens, block_size=16) == []  # xxh3 names other blocks


@pytest.mark.parametrize("multi", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_scores_equal_the_per_block_definition(tmp_path, seed, multi):
    """Each block of an instance's prefix counts the best medium holding it; instances in
    one medium take the shortcut (no per-block work), the others the per-block path. An
    index where no instance holds two media is matched without presence at all."""
    rng = np.random.default_rng(seed)
    weights = {"GPU": 1.0, "CPU": 0.7, "DISK": 0.4}
    chains = [[1000 * c + k for k in range(12)] for c in range(3)]
    with sarp.open(tmp_path / "ix", durability="nosync", segment_blocks=4) as index:
        for _ in range(30):
            chain = chains[rng.integers(3)]
            holder = f"w{rng.integers(4)}"
            medium = ["GPU", "CPU", "DISK"][rng.integers(3 if holder == "w0" and multi else 1)]
            lo, hi = sorted(rng.integers(0, 13, 2).tolist())
            if rng.random() < 0.7 and hi:
                index.insert(chain[:hi], holder=holder, medium=medium)
            elif hi > lo:
                index.remove(chain[lo:hi], holder=holder, medium=medium)
        for chain in chains:
            query = chain + [7]
            m, scores = score_match(index, query, weights=weights)
            assert bool(m.presence) == (index.multi_medium and m.num_blocks > 0)
            full = index.match(query, with_presence=True)
            expected = {}
            for instance, blocks in full.by_holder.items():
                media = [md for (inst, md) in full.presence if inst == instance]
                best = [max((md for md in media if full.presence[(instance, md)][k]),
                            key=weights.get) for k in range(blocks)]
                expected[instance] = ({md: best.count(md) for md in set(best)},
                                      sum(weights[md] for md in best))
            got = {s.instance: (s.by_medium, s.score) for s in scores}
            assert got.keys() == expected.keys()
            for instance, (by_medium, total) in expected.items():
                assert got[instance][0] == by_medium
                assert got[instance][1] == pytest.approx(total)
