"""The event decoder in C (`sarp._native.decode_batch`) against the Python decoder:
the same batch, or the same error, for what engines send and for what they should not."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from sarp import native
from sarp.serving import events as ev

pytestmark = pytest.mark.skipif(
    not native.AVAILABLE, reason=f"sarp._native {native.WHY} (SARP_REQUIRE_NATIVE=1, as "
    "in CI, makes that a failure); the Python path is what every other test runs then")


def _c(payload: bytes):
    """The C decoder alone (None: it leaves the payload to Python)."""
    with native.forced("c"):
        return native.C.decode_batch(payload, True)


def _python(payload: bytes):
    """The Python decoder alone: its batch, or its error."""
    try:
        batch = ev._decode_common(payload)
        return _plain(batch if batch is not None else ev._decode_full(payload))
    except ev.BadEvent as exc:
        return ("BadEvent", str(exc))


def _either(payload: bytes):
    try:
        with native.forced("c"):
            return _plain(ev.decode(payload, tokens=True))
    except ev.BadEvent as exc:
        return ("BadEvent", str(exc))


def _plain(batch) -> tuple:
    """A batch as comparable values, types included (hashes: dtype and values)."""
    out = []
    for e in batch.events:
        fields = []
        for name in e.__slots__:
            value = getattr(e, name)
            if isinstance(value, np.ndarray):
                value = (str(value.dtype), value.tolist(), value.flags.writeable)
            fields.append((name, type(value).__name__, value))
        out.append((type(e).__name__, fields))
    return (type(batch.ts).__name__, batch.ts, batch.dp_rank, out)


def _random_event(rng: random.Random):
    hashes = [rng.choice([rng.getrandbits(64), rng.getrandbits(63) - (1 << 62), rng.randrange(300)])
              for _ in range(rng.choice([1, 2, 5, 40, 70]))]
    odd = rng.random() < 0.35  # then one field is something engines do not send
    value = rng.choice([None, True, 1.5, "x", b"\x00" * 8, [], {}, "\udcff", -3, 2**64 - 1,
                        msgpack.ExtType(5, b"ab"), {"k": [1]}, [[1], {"a": None}]])
    kind = rng.choice(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
    fields = {"block_hashes": hashes,
              "parent_block_hash": rng.choice([None, rng.getrandbits(64), hashes[0]]),
              "token_ids": [rng.randrange(1 << 17) for _ in range(16 * len(hashes))],
              "block_size": 16, "lora_id": rng.choice([None, 3]),
              "medium": rng.choice([None, "GPU", "cpu_pinned", "DISK", "bad medium!", ""]),
              "lora_name": rng.choice([None, "adapter"]), "extra_keys": rng.choice([None, [[1]]]),
              "group_idx": rng.choice([None, 0, 1])}
    if rng.random() < 0.1:
        fields["block_hashes"] = hashes + [hashes[0]]  # a repeat
    if rng.random() < 0.1:
        fields["block_hashes"] = [h.to_bytes(8, "big") for h in map(abs, hashes)]
    if odd:
        fields[rng.choice(list(fields))] = value
    names = {"BlockStored": ev._STORED_FIELDS, "BlockRemoved": ev._REMOVED_FIELDS}.get(kind, ())
    if rng.random() < 0.5:  # a tagged array, maybe cut short or with extra items
        items = [kind] + [fields.get(n) for n in names]
        cut = rng.choice([len(items), len(items), max(1, len(items) - 2), len(items) + 2])
        return (items + [value, None])[:cut]
    event = {"type": kind}
    event.update({n: fields[n] for n in names if fields.get(n) is not None or rng.random() < 0.2})
    if rng.random() < 0.1:
        event[rng.choice([7, "zz", None])] = value
    return event


def _random_payload(rng: random.Random) -> bytes:
    events = [_random_event(rng) for _ in range(rng.choice([0, 1, 1, 2, 5]))]
    ts = rng.choice([1.5, 3, 2**64 - 1, -2, 1e308, float("inf"), True, "t"] if rng.random() < 0.2
                    else [1700000000.25])
    shape = rng.random()
    if shape < 0.4:
        batch = [ts, events]
    elif shape < 0.9:
        batch = [ts, events, rng.choice([None, 0, 3, 4095, 4096, -1, True])]
    else:
        batch = {"ts": ts, "events": events, "data_parallel_rank": 0}
    payload = msgpack.packb(batch, use_bin_type=True, unicode_errors="surrogatepass")
    r = rng.random()
    if r < 0.1:
        payload = payload[: rng.randrange(len(payload))]
    elif r < 0.2:
        at = rng.randrange(len(payload))
        payload = payload[:at] + bytes([rng.randrange(256)]) + payload[at + 1:]
    return payload


@pytest.mark.parametrize("seed", range(6))
def test_c_decodes_what_python_decodes(seed):
    rng = random.Random(seed)
    in_c = 0
    for _ in range(1500):
        payload = _random_payload(rng)
        assert _either(payload) == _python(payload), payload
        in_c += _c(payload) is not None
    assert 200 < in_c < 1500  # C read many, and left many to Python


@pytest.mark.parametrize("style", ev.ENCODING_STYLES)
def test_c_reads_every_engine_encoding(style):
    rng = np.random.default_rng(0)
    chain = rng.integers(0, 1 << 64, 30, dtype=np.uint64)
    payload = ev.encode_batch([("stored", chain[:20], None, "GPU"),
                               ("stored", chain[20:], int(chain[19]), "CPU", 0),
                               ("removed", chain[25:], "cpu_pinned"), ("cleared",)],
                              ts=12.5, dp_rank=2, style=style)
    assert _c(payload) is not None
    assert _either(payload) == _python(payload)
    batch = ev.decode(payload)
    assert batch.events[1].block_hashes.tolist() == chain[20:].tolist()
    assert batch.events[2].medium == "CPU"


def test_a_field_python_cannot_build_is_left_to_python():
    """A map with a list as a key, inside a field the Python decoder builds (not one
    it reads past): unhashable there, so the payload is not a batch; C must agree."""
    list_keyed = b"\x81\x91\x01\x02"  # {[1]: 2}
    head = msgpack.packb(["BlockStored", [7, 8], None, [1, 2]])[:-3]  # up to token_ids
    stored = b"\x97" + head[1:] + msgpack.packb([1, 2])  # 7 items: ... token_ids,
    stored += list_keyed + msgpack.packb(None) + msgpack.packb("GPU")  # block_size, lora, medium
    payload = b"\x92" + msgpack.packb(1.0) + b"\x91" + stored
    assert _python(payload)[0] == "BadEvent"
    assert _c(payload) is None
    assert _either(payload) == _python(payload)
    # the same map where the decoder reads past it (token_ids) is no fault
    skipped = b"\x97" + head[1:] + list_keyed + msgpack.packb(16) + msgpack.packb(None) \
        + msgpack.packb("GPU")
    payload = b"\x92" + msgpack.packb(1.0) + b"\x91" + skipped
    assert _python(payload)[0] == "float"
    assert _c(payload) is not None
    assert _either(payload) == _python(payload)
