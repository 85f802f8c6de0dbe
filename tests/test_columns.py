"""A commit's events as columns (`sarp.serving.columns`): the C decoder against its
Python reference, and a stream applied through the columns against the same stream
applied as decoded events (`Applier.add`), table for table."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

import sarp
from sarp import native, tokenkeys
from sarp.bench import conformance as cf
from sarp.serving.applier import Applier, ApplyStats
from sarp.serving.columns import FIELDS, Columns
from sarp.serving.events import decode
from sarp.tokenkeys import model_root

pytestmark = pytest.mark.skipif(
    not native.AVAILABLE, reason=f"sarp._native {native.WHY} (SARP_REQUIRE_NATIVE=1, as "
    "in CI, makes that a failure); without it serve decodes every batch in Python")

ROOT = model_root("llama")


def _event(rng: random.Random, tagged: bool) -> object:
    """A store, a removal or now and then something the columns refuse."""
    n = rng.randint(1, 4)
    hashes = [rng.randrange(1, 50) for _ in range(n)]
    if rng.random() < 0.04:
        hashes[-1] = hashes[0]  # a repeated hash: malformed
    medium = rng.choice(["GPU", "GPU", "cpu", "CPU_PINNED", None, "disk", "GPU\x00", 7])
    group = rng.choice([None, None, None, 0, 1])
    roll = rng.random()
    if roll < 0.03:
        return ["AllBlocksCleared"] if tagged else {"type": "AllBlocksCleared"}
    if roll < 0.35:
        if tagged:
            return ["BlockRemoved", hashes, medium] + ([group] if group is not None else [])
        e = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
        return e | ({"group_idx": group} if group is not None else {})
    parent = rng.choice([None, rng.randrange(50, 60)])
    size = rng.choice([16, 16, 4, 0, None])
    tokens = [rng.randrange(1 << 17) for _ in range(n * (size or 1) + rng.choice([0, 0, 3, -1]))]
    if tokens and rng.random() < 0.05:  # not a token id: keyed through the engine's hashes
        tokens[rng.randrange(len(tokens))] = rng.choice([-1, -300, 1 << 32, 2.5])
    lora = rng.choice([None, None, "sql", ""])
    extra = rng.choice([None, None, [None] * n, [["sql"]] * n, [["img"]] * n])
    if tagged:
        return ["BlockStored", hashes, parent, tokens, size, None, medium, lora, extra, group]
    e = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
         "token_ids": tokens, "block_size": size, "medium": medium, "lora_name": lora}
    if extra is not None:
        e["extra_keys"] = extra
    return e | ({"group_idx": group} if group is not None else {})


def _payloads(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        tagged = rng.random() < 0.5
        events = [_event(rng, tagged) for _ in range(rng.randint(1, 4))]
        tail = rng.choice([[], [0], [None], [3]])
        out.append(msgpack.packb([rng.random() * 100, events, *tail]))
    return out


def _rows(cols: Columns) -> list[tuple]:
    """Every row with its name spelled out, its hashes and its blocks' local hashes."""
    t = cols.take()
    tokened = np.where(t.token_count != 0, t.size, 0)
    starts, lstarts = t.starts, np.cumsum(tokened) - tokened
    assert t.locals.size == tokened.sum()
    return [(*(int(getattr(t, f)[i]) for f in FIELDS[:9] if f != "name"),
             t.names[int(t.name[i])],
             t.hashes[starts[i] : starts[i] + t.size[i]].tolist(),
             t.locals[lstarts[i] : lstarts[i] + tokened[i]].tolist())
            for i in range(t.kind.size)]


def _locals(ids: list[int]) -> list[int]:
    """The local hashes of blocks of 16 token ids (no LoRA)."""
    return tokenkeys.token_keys(ids, 16, parent=0)[1].tolist()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("root", [None, ROOT], ids=["engine-keyed", "token-keyed"])
def test_c_columns_hold_what_the_python_reference_holds(seed, root):
    """Random payloads of both encodings (media sarp maps and refuses, other KV cache
    groups, LoRA names, extra keys, short or odd token ids, clears, repeated hashes):
    each one C takes, the reference takes the same way; each one C leaves, the columns
    are as they were."""
    c_cols, py_cols = Columns(), Columns()
    taken = left = 0
    for payload in _payloads(seed, 300):
        before = c_cols.mark()
        with native.forced("c"):
            got = c_cols.add(payload, "e#0", root, tokens=True)
        if got is None:
            assert c_cols.mark() == before
            left += 1
            continue
        with native.forced("python"):
            assert py_cols.add(payload, "e#0", root, tokens=True) == got
        taken += 1
    assert taken > 50 and left > 50
    assert _rows(c_cols) == _rows(py_cols)


def _int_as(value: int, form: int) -> bytes:
    """``value`` packed in msgpack int form ``form`` (0: a positive fixint)."""
    if form == 0:
        return bytes([value])
    width, sign = {0xCC: (1, ""), 0xCD: (2, ""), 0xCE: (4, ""), 0xCF: (8, ""),
                   0xD0: (1, "s"), 0xD1: (2, "s"), 0xD2: (4, "s"), 0xD3: (8, "s")}[form]
    return bytes([form]) + value.to_bytes(width, "big", signed=sign == "s")


def _tokens_both_ways(payload: bytes) -> list[int]:
    """The one event of ``payload`` added by C and by the Python reference: both take
    it and hold the same rows; its blocks' local hashes as the columns hold them."""
    c_cols, py_cols = Columns(), Columns()
    with native.forced("c"):
        got = c_cols.add(payload, "e#0", ROOT, tokens=True)
    with native.forced("python"):
        assert py_cols.add(payload, "e#0", ROOT, tokens=True) == got
    assert got is not None
    rows = _rows(c_cols)
    assert rows == _rows(py_cols)
    return rows[0][-1]


@pytest.mark.parametrize("seed", range(3))
def test_token_ids_in_any_int_form_are_read_as_msgpack_reads_them(seed):
    """Token ids packed in every form msgpack has for a non-negative int (a fixint,
    uint8 to uint64, int8 to int64), the last of them ending the payload: the columns
    hold the ids msgpack reads, as the Python reference does; one id that is not one
    (negative, 2^32) keys the store through the engine's hashes in both."""
    rng = random.Random(seed)
    forms = [0, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3]
    for case in range(40):
        blocks = rng.randint(1, 5)
        ids = [rng.choice([rng.randrange(128), rng.randrange(1 << 17), (1 << 32) - 1])
               for _ in range(16 * blocks)]
        body = b""
        for v in ids:
            fits = [f for f in forms if f == 0 and v < 128 or f in (0xCC, 0xD0) and v < 128
                    or f == 0xCC and v < 256 or f in (0xCD, 0xD1) and v < (1 << 15)
                    or f == 0xCD and v < (1 << 16) or f in (0xCE, 0xD2) and v < (1 << 31)
                    or f == 0xCE or f in (0xCF, 0xD3)]
            body += _int_as(v, rng.choice(fits))
        if case % 4 == 3:  # one that is not a token id
            at = rng.randrange(len(ids))
            bad = rng.choice([b"\xd0\xff", _int_as(1 << 32, 0xCF)])  # -1, 2^32
            parts = [_int_as(v, 0xCE) for v in ids]
            parts[at] = bad
            body = b"".join(parts)
        head = bytes([0xDC]) + len(ids).to_bytes(2, "big")
        event = {"type": "BlockStored", "block_hashes": list(range(1, blocks + 1)),
                 "parent_block_hash": None, "block_size": 16, "medium": "GPU",
                 "token_ids": [0xFFFFFFFE]}
        packed = msgpack.packb([1.0, [event]])
        assert packed.endswith(b"\x91\xce\xff\xff\xff\xfe")
        got = _tokens_both_ways(packed[:-6] + head + body)
        assert got == ([] if case % 4 == 3 else _locals(ids))


def test_token_ids_twice_in_a_map_the_last_counts_as_in_the_reference():
    """A map-form store naming ``token_ids`` twice (the C decoder reads them as it
    passes them): whichever of the two holds a bad id, and a removal carrying token
    ids, the columns hold what the Python reference (a dict: the last wins) holds."""
    good, other = list(range(100, 132)), list(range(7, 39))
    for first, last in [(good, other), (other, good), (good, [1, -1] * 16),
                        ([1, -1] * 16, good), (good, "text")]:
        for kind in ("BlockStored", "BlockRemoved"):
            items = [("type", kind), ("block_hashes", [5, 6]), ("token_ids", first),
                     ("block_size", 16), ("medium", "GPU"), ("token_ids", last)]
            event = bytes([0x80 | len(items)]) + b"".join(
                msgpack.packb(k) + msgpack.packb(v) for k, v in items)
            got = _tokens_both_ways(msgpack.packb([1.0, [0]])[:-1] + event)
            assert got == (_locals(last) if kind == "BlockStored" and last in (good, other)
                           else [])


def _stream(seed: int) -> list[tuple[int, bytes]]:
    """Four engines' payloads (vLLM 0.33 and 0.11, token ids, GPU and CPU, LoRA on one,
    a clear half way) serving requests with shared prefixes, in publish order."""
    tapes: list[list[bytes]] = [[] for _ in range(4)]

    class Tape:
        def __init__(self, out: list[bytes]) -> None:
            self.out = out

        def publish(self, payload: bytes) -> None:
            self.out.append(payload)

    engines = [cf.Engine(i + 1, 0, "llama", ("vllm-0.33", "vllm-0.11")[i % 2],
                         Tape(tapes[i]), gpu_blocks=60, cpu_blocks=90) for i in range(4)]
    rng = random.Random(seed)
    stems = [np.array([rng.randrange(1 << 30) for _ in range(rng.randint(1, 20))], np.uint64)
             for _ in range(12)]
    order: list[tuple[int, bytes]] = []
    for k in range(400):
        stem = stems[rng.randrange(len(stems))]
        ids = np.concatenate([stem[: rng.randint(1, stem.size)],
                              np.array([rng.randrange(1 << 30) for _ in range(rng.randint(0, 6))],
                                       np.uint64)])
        n = rng.randrange(4)
        before = len(tapes[n])
        if k == 200 and n == 1:
            engines[n].clear()
        engines[n].serve(ids, cf.LORA if n == 1 and rng.random() < 0.2 else None)
        if k % 40 == 7:  # a store whose parent nobody holds (an event was lost): refused
            lost = (rng.randrange(1 << 30), None)
            tapes[n].append(cf.encode([("stored", [(int(ids[-1]) + 1, None)], lost, "GPU")],
                                      engines[n].style, 0))
        order += [(n, p) for p in tapes[n][before:]]
    return order


def _tables(index) -> dict:
    """Every table as its entries; the aliases as those whose block is in the index,
    sorted (the writer's table in memory: which dead ones a sweep took first depends
    on the order it scans, which differs between C and Python)."""
    store = index._store
    with store.env.begin() as txn:
        out = {name: list(txn.cursor(db=getattr(store, name)))
               for name in ("segments_db", "blocks_db", "holders_db", "log_db")}
    roots, hashes, keys, _ = store.write(lambda w: w.alias_scan(None, 1 << 30))
    live = index._store.write(lambda w: w.locate(keys))[0] != 0
    out["aliases"] = sorted(zip(roots[live].tolist(), hashes[live].tolist(),
                                keys[live].tolist(), strict=True))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_a_stream_applied_through_the_columns_leaves_what_decoded_events_leave(tmp_path, seed):
    """The same token-keyed stream, in commits of 1 to 60 batches, through the columns
    (``add_payload``; a batch they leave, such as a clear, goes the other way) and
    through ``Applier.add``: every table byte for byte, the counts, the answers.  A
    batch the columns leave commits what they hold first (the columns go before it),
    so both lanes commit there."""
    stream = _stream(seed)
    probe = Columns()
    left = {i for i, (_, payload) in enumerate(stream)
            if probe.add(payload, "probe#0", ROOT, tokens=True) is None}
    rng = random.Random(seed)
    cuts = []
    while sum(cuts) < len(stream):
        cuts.append(rng.choice([1, 5, 20, 60]))
    outcomes = []
    for lane in ("columns", "events"):
        with sarp.open(tmp_path / lane, durability="nosync") as index:
            applier, stats = Applier(index), [ApplyStats() for _ in range(4)]
            at, took = 0, 0
            for cut in cuts:
                for i, (n, payload) in enumerate(stream[at : at + cut], at):
                    if i in left:
                        applier.flush()
                    holder = f"{n + 1}#0"
                    got = applier.add_payload(payload, holder, root=ROOT, tokens=True) \
                        if lane == "columns" else None
                    if got is not None:
                        applier.keep(stats[n], got[0])
                        took += 1
                    else:
                        applier.add(f"{n + 1}", decode(payload, True), stats[n], dp_rank=0,
                                    root=ROOT)
                applier.flush()
                at += cut
            counts = [(s.events, s.blocks_stored, s.blocks_removed, s.clears,
                       s.skipped_orphans, s.skipped_groups, s.batches, dict(s.bad_events))
                      for s in stats]
            answers = [index.match(np.array([h], np.uint64)).by_holder
                       for _, h in index.directory.entries().items()][:200]
            outcomes.append((_tables(index), counts, answers))
            assert index.check() == []
        if lane == "columns":
            assert took > len(stream) * 0.9  # all but the clears
    assert outcomes[0] == outcomes[1]
    assert sum(c[4] for c in outcomes[0][1]) >= 5  # the lost parents' stores were refused


def test_the_names_learned_start_again_past_the_bound():
    """Engines named anew for ever (or media) do not grow the columns' tables: past
    ``LEARNED`` they start again at a commit, and the rows still name what they
    named."""
    from sarp.serving import columns as columns_module

    cols, started_again = Columns(), 0
    raw = msgpack.packb([1.5, [["BlockStored", [7, 8], None, [], 16, None, "GPU"]]])
    for k in range(columns_module.LEARNED + 10):
        assert cols.add(raw, f"e{k}#0", None, tokens=False) is not None
        if k % 1000 == 999 or k == columns_module.LEARNED + 9:
            t = cols.take()
            assert [t.names[i] for i in t.name][-1] == f"e{k}#0\x00GPU"
            assert len(cols.names) + len(cols._holder_list) <= columns_module.LEARNED
            started_again += not cols.names
    assert started_again == 1


def test_columns_applied_without_the_extension_leave_what_they_leave_with_it(tmp_path):
    """``apply_decoded`` of the same columns on the Python path (operations rebuilt
    from the rows, ``aliases.pack``) and in C: every table the same."""
    stream = _stream(5)
    chunks: list[Columns] = []
    for i, (n, payload) in enumerate(stream):
        if i % 40 == 0:
            chunks.append(Columns())
        chunks[-1].add(payload, f"{n + 1}#0", ROOT, tokens=True)  # a clear: left out
    taken = [c.take() for c in chunks]
    tables = []
    for path in ("c", "python"):
        with sarp.open(tmp_path / path, durability="nosync") as index, native.forced(path), \
                native.Tally() as ran:
            results = [index.apply_decoded(t) for t in taken]
            tables.append((_tables(index), [(r.new_blocks, r.removed_per_op.tolist(),
                                             [(i, type(e).__name__) for i, e in r.failed])
                                            for r in results]))
        assert (ran.c("resolve_aliases") > 0) == (path == "c")
        assert (ran.python("resolve_aliases") > 0) == (path == "python")
    assert tables[0] == tables[1]
