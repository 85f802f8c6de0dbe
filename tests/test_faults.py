"""Seeded fault injection: damage an index at random, then read it in a child process.

Whatever the damage (flipped bits anywhere in data.mdb, a zeroed page, truncation, a
flipped bit in a segment record or a holder name), a reader either refuses with a
``SarpError`` or answers without a single block under a holder that did not hold it;
``sarp verify`` reports (exit 0 or 1), never crashes; ``sarp repair`` writes an index
that verifies clean and answers no block that was not held.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

import sarp

CHILD = r"""
import json, sys
import sarp
path, chains = sys.argv[1], json.loads(sys.argv[2])
try:
    with sarp.open(path, readonly=True) as index:
        print(json.dumps([index.match(c).by_holder for c, _ in chains]))
except sarp.SarpError as exc:
    print(json.dumps({"refused": type(exc).__name__}))
"""


def build(path, rng: random.Random):
    stored = []
    with sarp.open(path, segment_blocks=8, durability="nosync") as index:
        for i in range(60):
            chain = [rng.getrandbits(62) + 1 for _ in range(rng.randrange(3, 30))]
            holder = f"w{i % 3}"
            index.insert(chain, holder=holder)
            stored.append((chain, holder))
    return stored


def damage(path, rng: random.Random) -> str:
    data = path / "data.mdb"
    size = data.stat().st_size
    kind = rng.choice(["bits", "page", "truncate", "record", "name"])
    raw = bytearray(data.read_bytes())
    if kind == "bits":
        for _ in range(rng.randrange(1, 17)):
            raw[rng.randrange(size)] ^= 1 << rng.randrange(8)
    elif kind == "page":
        page = rng.randrange(2, size // 4096)
        raw[page * 4096 : (page + 1) * 4096] = bytes(4096)
    elif kind == "truncate":
        raw = raw[: rng.randrange(4096, size)]
    else:  # one bit inside a stored segment record, or inside a holder name
        needle = b"\x53\x47" if kind == "record" else b"w1\x00GPU"
        spots = [i for i in range(len(raw) - 8) if raw.startswith(needle, i)]
        if spots:
            at = rng.choice(spots) + rng.randrange(len(needle) + 6)
            raw[at] ^= 1 << rng.randrange(8)
    data.write_bytes(bytes(raw))
    return kind


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def no_false_positive(answers, stored) -> None:
    for by_holder, (chain, holder) in zip(answers, stored, strict=True):
        for name, blocks in by_holder.items():
            assert name == holder and blocks <= len(chain), (name, holder, blocks)


@pytest.mark.parametrize("seed", range(10))
def test_random_damage_never_gives_a_wrong_answer_or_a_dead_parent(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "ix"
    stored = build(path, rng)
    (path / "directory.snap").unlink()  # the rebuild must read the damaged file itself
    kind = damage(path, rng)
    out = run("-c", CHILD, path, json.dumps(stored))
    if out.returncode == 0:
        answer = json.loads(out.stdout)
        if isinstance(answer, list):
            no_false_positive(answer, stored)
    # else the reader died inside LMDB on the damage (its own process): never wrong
    verify = run("-m", "sarp.cli", "verify", path)
    assert verify.returncode in (0, 1), (kind, verify.stderr[-500:])
    assert "Traceback" not in verify.stderr, (kind, verify.stderr[-500:])
    repaired = run("-m", "sarp.cli", "repair", path, "--out", tmp_path / "new")
    if repaired.returncode == 0:
        assert run("-m", "sarp.cli", "verify", tmp_path / "new").returncode == 0
        out = run("-c", CHILD, tmp_path / "new", json.dumps(stored))
        no_false_positive(json.loads(out.stdout), stored)
    else:
        assert "sarp repair:" in repaired.stderr, (kind, repaired.stderr[-500:])
