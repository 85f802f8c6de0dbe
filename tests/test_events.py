"""KV event decoding and applying: every shape engines put on the wire, built with
msgpack the way they build it, and fuzzed payloads that must never crash."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

import sarp
from sarp.serving.applier import apply
from sarp.serving.events import (
    ENCODING_STYLES,
    BadEvent,
    Cleared,
    Malformed,
    Removed,
    Stored,
    decode,
    encode_batch,
)

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


def test_vllm_033_positional_batch_of_tagged_maps_with_bytes_hashes():
    # vLLM 0.12 on: the batch stays an array, events are maps tagged "type" whose
    # default-valued fields are omitted; bytes hashes when int hashes are off.
    h1, h2 = b"\x01" * 24 + BIG.to_bytes(8, "big"), (77).to_bytes(32, "big")
    payload = msgpack.packb([
        3.0,
        [
            {"type": "BlockStored", "block_hashes": [h1, h2],
             "parent_block_hash": (9).to_bytes(32, "big"), "token_ids": [], "block_size": 16,
             "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1,
             "kv_cache_spec_kind": "full_attention", "locality": "LOCAL"},
            {"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU", "group_idx": 1},
            {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
             "token_ids": [], "block_size": 16, "lora_id": None, "medium": "STORAGE",
             "lora_name": None},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ], use_bin_type=True)
    batch = decode(payload)
    assert batch.dp_rank == 0
    assert batch.events[0].block_hashes.tolist() == [BIG, 77]
    assert batch.events[0].parent == 9 and batch.events[0].group_idx == 1
    assert batch.events[1].block_hashes.tolist() == [77]
    assert batch.events[2].group_idx is None and batch.events[2].medium == "DISK"


def test_sglang_positional_batch_signed_hashes_and_attn_dp_rank():
    # SGLang 0.5.x: [ts, events, attn_dp_rank] with the rank always present, tagged-map
    # events, hashes as signed int64, its host tier named CPU_PINNED, medium omitted
    # when None.
    payload = msgpack.packb([1, [
        {"type": "BlockStored", "block_hashes": [BIG - 2**64, -1], "parent_block_hash": -5,
         "token_ids": [], "block_size": 64, "lora_id": None, "medium": "CPU_PINNED"},
        {"type": "BlockRemoved", "block_hashes": [-1]}], 2])
    batch = decode(payload)
    assert batch.dp_rank == 2
    assert batch.events[0].block_hashes.tolist() == [BIG, 2**64 - 1]
    assert batch.events[0].parent == 2**64 - 5 and batch.events[0].medium == "CPU"
    assert batch.events[1].medium == "GPU"
    assert decode(msgpack.packb([1, [], None])).dp_rank is None


def test_a_map_batch_is_still_read():
    payload = msgpack.packb({"ts": 1, "events": [["AllBlocksCleared"]], "attn_dp_rank": 2})
    assert decode(payload).dp_rank == 2


@pytest.mark.parametrize("style", ENCODING_STYLES)
def test_encode_batch_round_trips_every_engine_style(style):
    raw = encode_batch([("stored", [BIG, 3], 1, "CPU"), ("removed", [3], "CPU"), ("cleared",)],
                       ts=2.0, dp_rank=1, style=style)
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
    (msgpack.packb([float("nan"), []]), "finite"),
    (msgpack.packb([1.0, "events"]), "events must be an array"),
    (msgpack.packb([1.0, [], -1]), "dp rank"),
    (msgpack.packb([1.0, [], 10**6]), "dp rank"),
])
def test_unreadable_batches_are_refused_with_a_reason(payload, words):
    with pytest.raises(BadEvent, match=words):
        decode(payload)


@pytest.mark.parametrize("event, kind", [
    (["Nope", [1]], "unknown_type"),
    ({"block_hashes": [1]}, "unknown_type"),
    (["BlockStored", [], None], "bad_hashes"),
    (["BlockStored", [1.5], None], "bad_hashes"),
    (["BlockStored", [[1, 2]], None], "bad_hashes"),
    (["BlockStored", [1], "parent"], "bad_hashes"),
    (["BlockStored", [777, 778, 777], None], "repeated_hash"),
    (["BlockStored", [5, 6, 7], 6], "parent_in_chain"),
    (["BlockStored", [5], None, [], 16, None, "GP\x00U"], "bad_medium"),
    (["BlockStored", [5], None, [], 16, None, "M" * 1000], "bad_medium"),
    (["BlockRemoved", [1], 7], "bad_medium"),
    ({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": "0"},
     "bad_group"),
    ([], "malformed"),
    (7, "malformed"),
])
def test_a_bad_event_decodes_to_malformed_with_its_kind(event, kind):
    batch = decode(msgpack.packb([1.0, [event, ["AllBlocksCleared"]], 0]))
    bad, good = batch.events
    assert isinstance(bad, Malformed) and bad.kind == kind
    assert isinstance(good, Cleared)


def test_fuzzed_payloads_never_raise_anything_but_bad_event():
    rng = random.Random(1234)
    good = [encode_batch([("stored", [rng.getrandbits(64) for _ in range(5)], None, "GPU"),
                          ("removed", [1, 2], "GPU"), ("cleared",)], style=k)
            for k in ("vllm-0.11", "vllm-0.33")]
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


def test_bad_events_in_a_batch_are_counted_and_the_good_ones_applied(tmp_path):
    # Each bad event below stopped `sarp serve` before (issue 11, item 1).
    payload = msgpack.packb([5.0, [
        ["BlockStored", [1, 2, 3], None, [], 16, None, "GPU"],
        ["BlockStored", [777, 778, 777], None, [], 16, None, "GPU"],
        ["BlockStored", [40], None, [], 16, None, "GPU\x00"],
        ["BlockStored", [41], None, [], 16, None, "M" * 1000],
        ["BlockStored", [2], None, [], 16, None, "GPU"],  # block 2 re-stored at position 0
        ["BlockStored", [50, 51], 51, [], 16, None, "GPU"],  # parent inside its own chain
        ["BlockStored", [4], 3, [], 16, None, "GPU"],
        ["BlockStored", [1, 2], None, [], 16, None, "CPU"],
        ["BlockRemoved", [2], "bad medium!"],  # hashes readable: drop 2 in every medium
        ["Unknown", 1],
    ], 0])
    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        stats = apply(index, "e", decode(payload))
        assert dict(stats.bad_events) == {"repeated_hash": 1, "bad_medium": 3,
                                          "chain_conflict": 1, "parent_in_chain": 1,
                                          "unknown_type": 1}
        assert stats.events == 10 and stats.blocks_stored == 3 + 1 + 2
        assert index.match([1, 2, 3, 4]).by_medium == {"e#0": {"GPU": 1, "CPU": 1}}
        assert index.match([777]).num_blocks == 0 and index.match([50]).num_blocks == 0
        assert {m for _, m in index.holders_list()} == {"GPU", "CPU"}
        # A removal whose hashes cannot be read: only forgetting the holder is safe.
        apply(index, "e", decode(msgpack.packb([6.0, [["BlockRemoved", "zz", "GPU"]], 0])))
        assert index.match([1]).num_blocks == 0
        assert index.check() == []


def test_media_aliases_map_to_canonical_tiers(tmp_path):
    events = [("stored", [1, 2], None, "CPU_PINNED"), ("stored", [1, 2], None, "cpu"),
              ("stored", [1], None, "STORAGE"), ("stored", [1], None, "gpu"),
              ("stored", [1], None, "EXTERNAL")]
    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        apply(index, "e", decode(encode_batch(events, dp_rank=0, style="vllm-0.33")))
        assert sorted(m for _, m in index.holders_list()) == ["CPU", "DISK", "EXTERNAL", "GPU"]
        apply(index, "e", decode(encode_batch([("removed", [2], "cpu_pinned")], dp_rank=0,
                                              style="sglang")))
        assert index.blocks_of("e#0", medium="CPU").tolist() == [1]


def _same_batch(a, b, tokens: bool = True) -> bool:
    def same_event(x, y) -> bool:
        if type(x) is not type(y):
            return False
        for name in x.__slots__:
            if not tokens and name in ("token_ids", "block_size"):
                continue
            u, v = getattr(x, name), getattr(y, name)
            if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
                if u is None or v is None or u.dtype != v.dtype or not np.array_equal(u, v):
                    return False
            elif u != v:
                return False
        return True

    return (a.ts, a.dp_rank, len(a.events)) == (b.ts, b.dp_rank, len(b.events)) and all(
        same_event(x, y) for x, y in zip(a.events, b.events, strict=True))


def test_reading_past_token_ids_gives_what_the_full_decode_gives():
    """decode() reads the common shape without building the token ids; for engines'
    payloads in every style, and for fuzzed ones, it answers (or refuses) exactly as
    building the whole payload does, except that it does not check the text inside the
    fields it reads past."""
    from sarp.serving.events import _decode_common, _decode_full

    rng = random.Random(99)

    def events() -> list[tuple]:
        out = []
        for _ in range(rng.randrange(1, 5)):
            r = rng.random()
            hashes = [rng.getrandbits(64) for _ in range(rng.randrange(1, 9))]
            if r < 0.5:
                out.append(("stored", hashes, rng.choice([None, rng.getrandbits(64)]),
                            rng.choice(["GPU", "cpu", "DISK"])))
            elif r < 0.9:
                out.append(("removed", hashes, "GPU"))
            else:
                out.append(("cleared",))
        return out

    good = [encode_batch(events(), style=style, dp_rank=rng.choice([None, 0, 3]),
                         ts=rng.random() * 1e9)
            for style in ENCODING_STYLES for _ in range(30)]
    junk = [None, True, -1, 2**64 - 1, -(2**63), 1.5, "s", b"b", [], {}, [[]], {"type": 1},
            [1, 1], [[1]] * 3]
    payloads = list(good)
    base_of = {}
    for i in range(3000):
        base = good[i % len(good)]
        kind = i % 3
        if kind == 0:
            payloads.append(base[: rng.randrange(len(base))])
        elif kind == 1:
            mutated = bytearray(base)
            for _ in range(2):
                mutated[rng.randrange(len(mutated))] = rng.getrandbits(8)
            payloads.append(bytes(mutated))
            base_of[payloads[-1]] = base
        else:
            obj = msgpack.unpackb(base, strict_map_key=False)
            if obj[1]:
                event = obj[1][rng.randrange(len(obj[1]))]
                keys = list(event) if isinstance(event, dict) else list(range(len(event)))
                event[rng.choice(keys)] = rng.choice(junk)
            if rng.random() < 0.1:
                obj.append(rng.choice(junk))  # a fourth element, or a bad dp rank
            payloads.append(msgpack.packb(obj))
    streamed = lenient = 0
    for payload in payloads:
        try:
            want = _decode_full(payload)
        except BadEvent:
            if _decode_common(payload) is not None:
                # Read past unchecked: bytes inside the token ids that are not valid
                # text (or a valid extension) sink the full decode only. Such a
                # mutant still decodes to its unmutated payload's events, but for the
                # token ids, which it no longer has (they are not all ints).
                assert _same_batch(decode(payload, tokens=True),
                                   _decode_full(base_of[payload]), tokens=False)
                lenient += 1
            else:
                with pytest.raises(BadEvent):
                    decode(payload)
            continue
        got = decode(payload, tokens=True)
        assert _same_batch(got, want), payload
        streamed += _decode_common(payload) is not None
    assert all(_decode_common(p) is not None for p in good)  # engines' shape: streamed
    assert streamed > len(good) + 500  # and most readable mutants too
    assert lenient < 50
