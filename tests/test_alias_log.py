"""LMDB's aliases written behind (``sarp.alias_log``): a writer SIGKILLed with its
aliases in ``aliaslog`` and memory loses none of them, the records a round of merges
covered are deleted, and an index of format 1 opens as format 2."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap

import lmdb
import numpy as np

import sarp
from sarp.serving.applier import Applier, ApplyStats
from sarp.serving.events import decode, encode_batch
from sarp.store import FORMAT_VERSION
from sarp.tokenkeys import model_root, token_keys

ROOT = model_root("llama")
CHAINS, BLOCKS = 40, 4  # chains of engine e0, each BLOCKS blocks with tokens


def _tokens(i: int) -> list[int]:
    return [(7919 * i + j) % 151_936 for j in range(16 * BLOCKS)]


def _hashes(i: int) -> list[int]:
    return [(i << 8) + (j << 60) + j + 1 for j in range(BLOCKS)]  # spread over slices


def _feed(index, events: list[tuple], tokens: list) -> ApplyStats:
    stats, applier = ApplyStats(), Applier(index)
    applier.add("e0", decode(encode_batch(events, token_ids=tokens, dp_rank=0), True), stats,
                root=ROOT)
    applier.flush()
    return stats


def _aliaslog_records(path) -> int:
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8)
    try:
        with env.begin() as txn:
            return txn.stat(env.open_db(b"aliaslog", txn=txn, create=False))["entries"]
    finally:
        env.close()


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import sarp, test_alias_log as t
    index = sarp.open({path!r})  # the default durability
    index._store.alias_log.max_pending = 1 << 20  # nothing merged: all in the log
    for i in range(t.CHAINS):
        t._feed(index, [("stored", t._hashes(i), None, "GPU")], [t._tokens(i)])
        print(i, flush=True)  # returned: acknowledged
    time.sleep(60)  # SIGKILLed here
""")


def test_a_sigkilled_writer_loses_no_alias_it_acknowledged(tmp_path):
    """A writer whose aliases are all in ``aliaslog`` and memory (none merged) is
    SIGKILLed; the index opened again resolves every engine hash it acknowledged:
    an offload store without tokens lands on the blocks, and removals by engine hash
    take every block out."""
    path = tmp_path / "ix"
    tests = os.path.dirname(__file__)
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=tests, path=str(path))],
                             stdout=subprocess.PIPE, text=True)
    try:
        for i in range(CHAINS):
            assert child.stdout.readline().split() == [str(i)]
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    assert _aliaslog_records(path) == CHAINS  # every alias in the log, none in the table
    with sarp.open(path) as index:
        assert len(index._store.alias_log.pending) == CHAINS * BLOCKS
        every = np.concatenate([token_keys(_tokens(i), 16, parent=ROOT)[0]
                                for i in range(CHAINS)])
        stats = _feed(index, [("stored", _hashes(i)[:2], None, "CPU") for i in range(CHAINS)],
                      [[]] * CHAINS)  # no tokens: resolved through the aliases
        assert stats.blocks_stored == 2 * CHAINS and stats.skipped_orphans == 0
        stats = _feed(index, [("removed", _hashes(i), "GPU") for i in range(CHAINS)]
                      + [("removed", _hashes(i)[:2], "CPU") for i in range(CHAINS)],
                      [None] * 2 * CHAINS)
        assert stats.blocks_removed == (BLOCKS + 2) * CHAINS
        assert index.blocks_of("e0#0", "GPU").size == index.blocks_of("e0#0", "CPU").size == 0
        assert all(index.match(every[BLOCKS * i : BLOCKS * (i + 1)]).num_blocks == 0
                   for i in range(CHAINS))


def test_merged_records_are_deleted_and_the_table_holds_the_aliases(tmp_path):
    """With merges due at every commit, the log keeps about a round of slices' records
    (not one per commit), and after a close and an open the aliases are in the table
    or read back, each resolving."""
    path = tmp_path / "ix"
    with sarp.open(path, durability="nosync") as index:
        index._store.alias_log.max_pending = 8
        for i in range(CHAINS):
            _feed(index, [("stored", _hashes(i), None, "GPU")], [_tokens(i)])
        merged = index._store.write(lambda w: len(w.alias_scan(None, 1 << 20)[0]))
        assert merged >= CHAINS * BLOCKS - 8 - BLOCKS  # all but what memory may keep
    assert 0 < _aliaslog_records(path) <= 2 * 16
    with sarp.open(path, durability="nosync") as index:
        stats = _feed(index, [("removed", _hashes(i), "GPU") for i in range(CHAINS)],
                      [None] * CHAINS)
        assert stats.blocks_removed == BLOCKS * CHAINS


def test_an_index_of_format_1_opens_as_format_2(tmp_path):
    """Format 1 had no ``aliaslog``: a writer's open takes it to 2 (which a sarp of
    format 1 refuses, so it never writes aliases past a log it cannot read)."""
    path = tmp_path / "ix"
    with sarp.open(path) as index:
        _feed(index, [("stored", _hashes(0), None, "GPU")], [_tokens(0)])
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", struct.pack(">Q", 1), db=env.open_db(b"meta", txn=txn))
    env.close()
    with sarp.open(path, readonly=True) as reader:  # a reader opens it as it is
        assert reader.match(token_keys(_tokens(0), 16, parent=ROOT)[0]).num_blocks == BLOCKS
    with sarp.open(path) as index:
        assert index._store.format_version == FORMAT_VERSION == 2
        assert _feed(index, [("removed", _hashes(0), "GPU")], [None]).blocks_removed == BLOCKS
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8)
    with env.begin() as txn:
        meta = env.open_db(b"meta", txn=txn, create=False)
        assert struct.unpack(">Q", txn.get(b"format_version", db=meta))[0] == 2
    env.close()
