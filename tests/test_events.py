"""KV event decoding and applying: every shape engines put on the wire, built with
msgpack the way they build it, and fuzzed payloads that must never crash."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

import sarp
from sarp.events import BadEvent, Cleared, Removed, Stored, apply, decode, encode_batch

BIG = 2**64 - 7  # a uint64 hash above 2**63: SGLang sends it as a negative int64


def test_vllm_positional_batch_with_dp_rank_and_extra_trailing_fields():
    payload = msgpack.packb([
        12.5,
        [
            ["BlockStored", [BIG, 5], None, [1, 2, 3], 16, None, "GPU", "lora-a", None, 0,
             "full_attention", None, "a-future-field"],
            ["BlockRemoved", [5], "CPU", 0, "a-future-field"],
            ["AllBlocksCleared"],
        ],
        3,
    ])
    batch = decode(payload)
    assert batch.ts == 12.5 and batch.dp_rank == 3
    stored, removed, cleared = batch.events
    assert isinstance(stored, Stored) and stored.block_hashes.tolist() == [BIG, 5]
    assert stored.parent is None and stored.medium == "GPU" and stored.lora_name == "lora-a"
    assert stored.group_idx == 0
    assert isinstance(removed, Removed) and removed.medium == "CPU"
    assert removed.block_hashes.tolist() == [5]
    assert isinstance(cleared, Cleared)


def test_vllm_positional_batch_of_the_oldest_shape():
    # [ts, events] with 6-field BlockStored (no lora_name) and 2-field BlockRemoved.
    payload = msgpack.packb([1.0, [["BlockStored", [1, 2], 9, [], 16, None],
                                   ["BlockRemoved", [2]]]])
    stored, removed = decode(payload).events
    assert stored.parent == 9 and stored.medium == "GPU"
    assert removed.medium == "GPU"


def test_vllm_keyed_batch_with_bytes_hashes():
    h1, h2 = b"\x01" * 24 + BIG.to_bytes(8, "big"), (77).to_bytes(32, "big")
    payload = msgpack.packb({
        "ts": 3.0,
        "events": [
            {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": (9).to_bytes(
                32, "big"), "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU",
             "lora_name": None, "extra_keys": None, "group_idx": 1, "unknown": {"x": 1}},
            {"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU", "group_idx": 1},
            {"type": "AllBlocksCleared"},
        ],
        "data_parallel_rank": 0,
    }, use_bin_type=True)
    batch = decode(payload)
    assert batch.dp_rank == 0
    assert batch.events[0].block_hashes.tolist() == [BIG, 77]
    assert batch.events[0].parent == 9 and batch.events[0].group_idx == 1
    assert batch.events[1].block_hashes.tolist() == [77]


def test_sglang_signed_hashes_and_attn_dp_rank():
    payload = msgpack.packb({"ts": 1, "events": [
        {"type": "BlockStored", "block_hashes": [BIG - 2**64, -1], "parent_block_hash": -5,
         "token_ids": [], "block_size": 64, "lora_id": None, "medium": None}],
        "attn_dp_rank": 2})
    batch = decode(payload)
    assert batch.dp_rank == 2
    assert batch.events[0].block_hashes.tolist() == [BIG, 2**64 - 1]
    assert batch.events[0].parent == 2**64 - 5 and batch.events[0].medium == "GPU"


@pytest.mark.parametrize("keyed", [False, True])
def test_encode_batch_round_trips_both_shapes(keyed):
    raw = encode_batch([("stored", [BIG, 3], 1, "CPU"), ("removed", [3], "CPU"), ("cleared",)],
                       ts=2.0, dp_rank=1, keyed=keyed)
    batch = decode(raw)
    assert batch.dp_rank == 1 and batch.ts == 2.0
    assert batch.events[0] == Stored(batch.events[0].block_hashes, 1, "CPU")
    assert batch.events[0].block_hashes.tolist() == [BIG, 3]
    assert isinstance(batch.events[2], Cleared)


@pytest.mark.parametrize("payload, words", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1.0, [["BlockStored", [1, 2]]]])[:-1], "not msgpack"),
    (msgpack.packb(5), "batch"),
    (msgpack.packb(["x", []]), "ts"),
    (msgpack.packb([1.0, "events"]), "events must be an array"),
    (msgpack.packb([1.0, [], -1]), "data_parallel_rank"),
    (msgpack.packb([1.0, [["Nope", [1]]]]), "unknown event type"),
    (msgpack.packb([1.0, [["BlockStored", [], None]]]), "non-empty"),
    (msgpack.packb([1.0, [["BlockStored", [1.5], None]]]), "float"),
    (msgpack.packb([1.0, [["BlockStored", [[1, 2]], None]]]), "list"),
    (msgpack.packb([1.0, [["BlockRemoved", [1], 7]]]), "medium"),
    (msgpack.packb([1.0, [["BlockStored", [1], "parent"]]]), "parent"),
    (msgpack.packb({"ts": 1, "events": [{"block_hashes": [1]}]}), "unknown event type"),
])
def test_malformed_payloads_are_refused_with_a_reason(payload, words):
    with pytest.raises(BadEvent, match=words):
        decode(payload)


def test_fuzzed_payloads_never_raise_anything_but_bad_event():
    rng = random.Random(1234)
    good = [encode_batch([("stored", [rng.getrandbits(64) for _ in range(5)], None, "GPU"),
                          ("removed", [1, 2], "GPU"), ("cleared",)], keyed=k) for k in (0, 1)]
    junk = [None, True, -1, 2**64 - 1, -(2**63), 1.5, "s", b"b", [], {}, [[]], {"type": 1}]
    decoded = refused = 0
    for i in range(3000):
        kind = i % 4
        if kind == 0:
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
        elif kind == 1:
            base = good[i % 2]
            payload = base[: rng.randrange(len(base))]
        elif kind == 2:
            base = bytearray(good[i % 2])
            for _ in range(3):
                base[rng.randrange(len(base))] = rng.getrandbits(8)
            payload = bytes(base)
        else:
            obj = msgpack.unpackb(good[i % 2], strict_map_key=False)
            target = obj["events"] if isinstance(obj, dict) else obj[1]
            event = target[rng.randrange(len(target))]
            keys = list(event) if isinstance(event, dict) else list(range(len(event)))
            event[rng.choice(keys)] = rng.choice(junk)
            payload = msgpack.packb(obj)
        try:
            decode(payload)
            decoded += 1
        except BadEvent:
            refused += 1
    assert decoded + refused == 3000 and refused > 1000


def test_apply_maps_events_to_holders_and_media(tmp_path):
    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        stats = apply(index, "engine-a", decode(encode_batch(
            [("stored", [1, 2, 3], None, "GPU"), ("stored", [4], 3, "GPU")], dp_rank=1)))
        apply(index, "engine-b", decode(encode_batch([("stored", [1, 2], None, "CPU")])))
        m = index.match([1, 2, 3, 4])
        assert m.by_medium == {"engine-a#1": {"GPU": 4}, "engine-b": {"CPU": 2}}
        assert stats.blocks_stored == 4 and stats.events == 2
        # A store whose parent was never seen (its event was lost) is skipped, counted.
        stats = apply(index, "engine-b", decode(encode_batch([("stored", [9], 777, "GPU")])))
        assert stats.skipped_orphans == 1 and index.match([9]).num_blocks == 0
        apply(index, "engine-a", decode(encode_batch([("removed", [4], "GPU")], dp_rank=1)))
        assert index.match([1, 2, 3, 4]).by_holder == {"engine-a#1": 3, "engine-b": 2}
        apply(index, "engine-a", decode(encode_batch([("cleared",)], dp_rank=1)))
        assert index.match([1, 2, 3, 4]).by_holder == {"engine-b": 2}
        assert index.check() == []


def test_decoded_hashes_are_uint64_arrays():
    batch = decode(encode_batch([("stored", [1, BIG], None, "GPU")]))
    assert batch.events[0].block_hashes.dtype == np.uint64


def test_only_the_first_kv_cache_group_is_applied(tmp_path):
    payload = msgpack.packb({"ts": 1.0, "events": [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU", "group_idx": 0},
        {"type": "BlockStored", "block_hashes": [1, 2, 3], "parent_block_hash": None,
         "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU", "group_idx": 1},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 1},
    ]})
    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        stats = apply(index, "e", decode(payload))
        assert stats.skipped_groups == 2
        assert index.match([1, 2, 3]).by_holder == {"e": 2}
