"""`sarp repair`: a new index from what can still be read, never a copy of damage."""

from __future__ import annotations

import random
import re
import struct
import subprocess
import sys

import lmdb
import pytest

import sarp
from sarp.repair import repair


def build(path, seed: int = 5, chains: int = 300):
    """Chains under two holders, in small segments (many records, many pages)."""
    rng = random.Random(seed)
    stored = []
    with sarp.open(path, segment_blocks=16, durability="nosync") as index:
        for i in range(chains):
            chain = [rng.getrandbits(62) + 1 for _ in range(rng.randrange(4, 40))]
            holder = "w0" if i % 3 else "w1"
            index.insert(chain, holder=holder, medium="GPU" if i % 2 else "CPU")
            stored.append((chain, holder))
    return stored


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sarp.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def zero_page(path, which: float) -> None:
    data = path / "data.mdb"
    pages = data.stat().st_size // 4096
    page = max(2, int(pages * which))  # never the two meta pages
    with data.open("r+b") as f:
        f.seek(page * 4096)
        f.write(b"\0" * 4096)


def test_repair_of_an_intact_index_keeps_everything(tmp_path):
    stored = build(tmp_path / "old")
    out = run("repair", tmp_path / "old", "--out", tmp_path / "new")
    assert out.returncode == 0, out.stderr
    assert run("verify", tmp_path / "new").returncode == 0
    with sarp.open(tmp_path / "new", readonly=True) as index:
        for chain, holder in stored:
            assert index.match(chain).by_holder == {holder: len(chain)}


@pytest.mark.parametrize("where", [0.3, 0.5, 0.7, 0.9])
def test_repair_after_a_zeroed_page_keeps_most_chains_whole_and_verifies(tmp_path, where):
    stored = build(tmp_path / "old")
    with sarp.open(tmp_path / "old", readonly=True) as index:
        segments = index.stats()["segments"]
    env = lmdb.open(str(tmp_path / "old"), readonly=True, lock=False, max_dbs=8)
    with env.begin(db=env.open_db(b"segments", create=False)) as txn:
        live = {struct.unpack(">Q", key)[0] for key in txn.cursor().iternext(values=False)}
    env.close()
    assert len(live) == segments
    zero_page(tmp_path / "old", where)
    out = run("repair", tmp_path / "old", "--out", tmp_path / "new")
    assert out.returncode == 0, out.stderr
    # Every record is accounted for: kept, or lost with its page (nothing intact dropped).
    # An unreadable range lists every id in it, and most ids never named a segment (new
    # segments take every ID_STRIDE-th id): count the live ones among them.
    found, damaged = map(int, re.match(
        r"segments: (\d+) found, (\d+) damaged records dropped", out.stdout).groups())
    report = repair(tmp_path / "old", tmp_path / "again")
    assert (report.segments_found, report.segments_damaged) == (found, damaged)
    lost = len(set(report.segments_unreadable) & live)
    assert found + damaged + lost == segments
    verify = run("verify", tmp_path / "new")
    assert verify.returncode == 0, verify.stdout
    whole = 0
    with sarp.open(tmp_path / "new", readonly=True) as index:
        for chain, holder in stored:
            m = index.match(chain)
            assert set(m.by_holder) <= {holder}  # never a holder that did not hold it
            whole += m.by_holder.get(holder, 0) == len(chain)
    assert whole >= 0.8 * len(stored), f"{whole} of {len(stored)} chains whole\n{out.stdout}"


def test_repair_refuses_to_overwrite(tmp_path):
    build(tmp_path / "old", chains=3)
    (tmp_path / "new").mkdir()
    out = run("repair", tmp_path / "old", "--out", tmp_path / "new")
    assert out.returncode == 2 and "never overwrites" in out.stderr


_CUT_CHILD = """
import sys
import sarp
from sarp.errors import DamagedIndexError, StoreError
stored = eval(sys.stdin.read())
damaged = wrong = 0
with sarp.open(sys.argv[1], durability="nosync") as index:
    for chain, holder in stored:
        try:
            wrong += not set(index.match(chain).by_holder) <= {holder}
        except DamagedIndexError as exc:
            damaged += "sarp repair" in str(exc)
    try:
        index.insert([7, 8, 9], holder="w2")  # may meet a lost page: a failed write
    except StoreError:
        pass
print(damaged, wrong)
"""


def test_a_file_cut_past_its_roots_reads_as_damage_not_a_crash(tmp_path):
    """Cut short past every root its meta page names, the file passes the open's
    check; a writer's open appends zero pages up to LMDB's last page, so what was lost
    reads as damage (``DamagedIndexError`` naming repair, a failed write), never SIGBUS
    (the child's death, as it was), never a wrong holder; repair takes what is left."""
    from sarp.folder import tree_roots

    stored = build(tmp_path / "old", chains=1500)
    data = tmp_path / "old" / "data.mdb"
    page_size, roots = tree_roots(data)
    pages = data.stat().st_size // page_size
    cut = max(r for r in roots if r < pages) + 1
    assert cut < pages - 10, (cut, pages)
    with data.open("r+b") as f:
        f.truncate(cut * page_size)
    child = subprocess.run([sys.executable, "-c", _CUT_CHILD, str(tmp_path / "old")],
                           input=repr(stored), capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])  # -7: SIGBUS
    damaged, wrong = map(int, child.stdout.split())
    assert damaged > 0 and wrong == 0  # reads met lost pages, as damage naming repair
    assert data.stat().st_size > cut * page_size  # the writer's open covered the cut
    out = run("repair", tmp_path / "old", "--out", tmp_path / "new")
    assert out.returncode == 0, out.stderr
    assert run("verify", tmp_path / "new").returncode == 0


def test_repair_of_a_truncated_file_keeps_what_is_left(tmp_path):
    """A file cut short where its last transaction's main tree has its root (so the
    cut is past a page the index needs; where a cut lands in the file depends on
    which free pages LMDB reused): refused with the repair hint, then repaired."""
    from sarp.folder import tree_roots

    stored = build(tmp_path / "old")
    data = tmp_path / "old" / "data.mdb"
    page_size, (_, main_root) = tree_roots(data)
    assert 2 < main_root < data.stat().st_size // page_size
    with data.open("r+b") as f:
        f.truncate(main_root * page_size)
    refused = run("stats", tmp_path / "old")
    assert refused.returncode == 1 and "sarp repair" in refused.stderr
    out = run("repair", tmp_path / "old", "--out", tmp_path / "new")
    assert out.returncode == 0, out.stderr
    assert run("verify", tmp_path / "new").returncode == 0
    with sarp.open(tmp_path / "new", readonly=True) as index:
        for chain, holder in stored:
            assert set(index.match(chain).by_holder) <= {holder}
