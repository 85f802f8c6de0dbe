import numpy as np
import pytest

import sarp
from sarp.router import score


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
    index.insert(sarp.hash_blocks(tokens, 16), holder="e", medium="NVME")
    (only,) = score(index, token_ids=tokens, block_size=16, weights={"NVME": 0.25})
    assert only.matched_blocks == 4 and only.score == pytest.approx(1.0)
    (default,) = score(index, token_ids=tokens, block_size=16)
    assert default.score == pytest.approx(4 * 0.3)  # a medium with no weight given
    with pytest.raises(ValueError, match="block_size"):
        score(index, token_ids=tokens)
    with pytest.raises(ValueError, match="weight"):
        score(index, [1], weights={"GPU": -1})
    assert score(index, np.array([12345], np.uint64)) == []
