import os
import struct

import numpy as np
import pytest

import sarp


@pytest.fixture
def index(tmp_path):
    with sarp.open(tmp_path / "ix", durability="nosync", segment_blocks=4) as ix:
        yield ix


def chain(start, n):
    return list(range(start, start + n))


def test_match_returns_the_longest_held_prefix_across_segments(index):
    index.insert(chain(100, 10), holder="w0")  # 3 segments of S=4
    assert index.match(chain(100, 10)).num_blocks == 10
    assert index.match(chain(100, 7) + [5]).num_blocks == 7
    assert index.match([5] + chain(100, 5)).num_blocks == 0
    m = index.match(chain(100, 10) + [1, 2])
    assert m.num_blocks == 10 and m.by_holder == {"w0": 10}


def test_a_match_reads_about_one_record_per_segment(index):
    index.insert(chain(100, 40), holder="w0")
    m = index.match(chain(100, 40))
    assert m.num_blocks == 40
    assert m.storage_reads == 10  # 40 blocks / S=4, not 40 records


def test_branches_from_the_middle_of_a_segment_are_found(index):
    index.insert(chain(100, 6), holder="w0")
    index.insert([900, 901, 902], parent=101, holder="w1")  # branch after block 1
    m = index.match([100, 101, 900, 901, 902, 903])
    assert m.num_blocks == 5
    # w1 holds only 900.. (not 100, 101), so its own prefix is 0 and it is not listed.
    assert m.by_holder == {"w0": 2}
    assert index.match([100, 101, 102]).num_blocks == 3


def test_appending_to_a_chain_fills_its_tail_segment(index):
    index.insert([1, 2], holder="w0")
    index.insert([3], parent=2, holder="w0")
    index.insert([4, 5, 6], parent=3, holder="w0")
    assert index.stats()["segments"] == 2  # [1 2 3 4] [5 6], not four small ones
    assert index.match([1, 2, 3, 4, 5, 6]).storage_reads == 2


def test_holders_and_media_are_tracked_per_block(index):
    index.insert(chain(1, 8), holder="w0", medium="GPU")
    index.insert(chain(1, 3), holder="w1", medium="GPU")
    index.insert(chain(4, 5), parent=3, holder="w1", medium="CPU")
    m = index.match(chain(1, 8))
    assert m.num_blocks == 8
    # w1 holds blocks 1-3 on GPU and 4-8 on CPU: the whole prefix across tiers.
    assert m.by_holder == {"w0": 8, "w1": 8}
    assert m.by_medium == {"w0": {"GPU": 8}, "w1": {"GPU": 3}}


def test_prefix_needs_every_block_held(index):
    index.insert(chain(1, 8), holder="w0")
    index.remove([3], holder="w0")
    m = index.match(chain(1, 8))
    assert m.num_blocks == 2 and m.by_holder == {"w0": 2}
    index.insert([3], parent=2, holder="w1")
    m = index.match(chain(1, 8))
    assert m.num_blocks == 8
    assert m.by_holder == {"w0": 2}  # w0 lacks block 3; w1 lacks blocks 1-2


def test_meta_is_returned_for_the_verified_prefix(index):
    index.insert(chain(1, 6), holder="w0", meta=[10, 11, 12, 13, 14, 15])
    index.insert(chain(1, 2), holder="w1")
    m = index.match(chain(1, 5) + [99], with_meta=True)
    assert m.meta[("w0", "GPU")].tolist() == [10, 11, 12, 13, 14]
    assert m.meta[("w1", "GPU")].tolist() == [-1, -1]
    assert index.match(chain(1, 3)).meta == {}


def test_remove_of_what_is_not_there_is_a_counted_no_op(index):
    index.insert([1, 2, 3], holder="w0")
    assert index.remove([7, 8], holder="w0") == 0
    assert index.remove([1], holder="nobody") == 0
    assert index.remove([2], holder="w0", medium="CPU") == 0
    assert index.stats()["remove_missing"] == 4
    assert index.match([1, 2, 3]).num_blocks == 3


def test_segments_with_no_holder_left_are_deleted(index):
    index.insert(chain(1, 8), holder="w0")
    assert index.stats()["segments"] == 2
    index.remove(chain(5, 4), holder="w0")
    stats = index.stats()
    assert stats["segments"] == 1 and stats["blocks"] == 4 and stats["directory_entries"] == 1
    # The removed blocks can be stored again and found.
    index.insert(chain(5, 4), parent=4, holder="w1")
    assert index.match(chain(1, 8)).num_blocks == 8


def test_clear_forgets_one_holder_in_one_or_every_medium(index):
    index.insert(chain(1, 5), holder="w0", medium="GPU")
    index.insert(chain(1, 5), holder="w0", medium="CPU")
    index.insert(chain(1, 5), holder="w1")
    assert index.clear("w0", medium="GPU") == 5
    assert index.match(chain(1, 5)).by_medium["w0"] == {"CPU": 5}
    assert index.clear("w0") == 5
    assert index.match(chain(1, 5)).by_holder == {"w1": 5}
    assert index.clear("w1") == 5
    assert index.match(chain(1, 5)).num_blocks == 0
    assert index.stats()["segments"] == 0


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(hashes=[], holder="w0"), ValueError, "empty"),
        (dict(hashes=[1, 2**64], holder="w0"), ValueError, "outside 64 bits"),
        (dict(hashes=[1, 2, 1], holder="w0"), ValueError, "repeat"),
        (dict(hashes=[5], parent=777, holder="w0"), sarp.ParentNotFoundError, "777"),
        (dict(hashes=[5], holder=""), ValueError, "holder"),
        (dict(hashes=[5], holder="w0", medium=3), ValueError, "medium"),
        (dict(hashes=[5, 6], holder="w0", meta=[1]), ValueError, "one int per block"),
        (dict(hashes=[5], holder="w0", meta=[-2]), ValueError, "-1 is reserved"),
        (dict(hashes=[2], holder="w0"), sarp.ChainConflictError, "position"),
        (dict(hashes=[3], parent=1, holder="w0"), sarp.ChainConflictError, "after"),
    ],
)
def test_bad_inserts_raise_and_change_nothing(index, kwargs, error, words):
    index.insert([1, 2, 3], holder="w0")
    before = index.stats()
    with pytest.raises(error, match=words):
        index.insert(**kwargs)
    after = index.stats()
    for key in ("segments", "blocks", "directory_entries", "holders"):
        assert after[key] == before[key]
    assert index.match([1, 2, 3]).by_holder == {"w0": 3}


def test_parent_must_still_be_held(index):
    index.insert([1, 2], holder="w0")
    index.remove([2], holder="w0")  # block 2 stays in its segment, held by nobody
    with pytest.raises(sarp.ParentNotFoundError):
        index.insert([3], parent=2, holder="w0")


def test_errors_are_sarp_errors_and_value_errors():
    assert issubclass(sarp.ParentNotFoundError, sarp.SarpError)
    assert issubclass(sarp.ParentNotFoundError, ValueError)
    assert issubclass(sarp.StoreFullError, sarp.SarpError)


def test_reopen_keeps_everything(tmp_path):
    with sarp.open(tmp_path / "ix", segment_blocks=4) as ix:
        ix.insert(chain(1, 10), holder="w0", meta=chain(50, 10))
        ix.insert([77], parent=4, holder="w1", medium="CPU")
    with sarp.open(tmp_path / "ix") as ix:
        assert ix.stats()["recovered_from"] == "snapshot"
        m = ix.match(chain(1, 10), with_meta=True)
        assert m.num_blocks == 10 and m.meta[("w0", "GPU")].tolist() == chain(50, 10)
        m = ix.match([1, 2, 3, 4, 77])
        assert m.num_blocks == 5  # 77 is held by w1 alone, which lacks blocks 1-4
        assert m.by_medium == {"w0": {"GPU": 4}}


def test_use_after_close_raises(tmp_path):
    ix = sarp.open(tmp_path / "ix")
    ix.close()
    ix.close()  # twice is fine
    with pytest.raises(sarp.IndexClosedError):
        ix.match([1])


def test_a_path_that_is_not_an_index_is_refused(tmp_path):
    (tmp_path / "file").write_text("hello")
    with pytest.raises(sarp.NotAnIndexError, match="is a file"):
        sarp.open(tmp_path / "file")
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("x")
    with pytest.raises(sarp.NotAnIndexError, match="non-empty directory"):
        sarp.open(tmp_path / "stuff")
    with pytest.raises(sarp.NotAnIndexError, match="does not exist"):
        sarp.open(tmp_path / "missing", create=False)
    assert os.listdir(tmp_path / "stuff") == ["notes.txt"]


def test_an_index_from_a_newer_format_is_refused(tmp_path):
    import lmdb

    with sarp.open(tmp_path / "ix") as ix:
        ix.insert([1], holder="w0")
    env = lmdb.open(str(tmp_path / "ix"), max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format_version", struct.pack(">Q", 99), db=meta)
    env.close()
    with pytest.raises(sarp.FormatVersionError, match="newer"):
        sarp.open(tmp_path / "ix")


def test_one_process_owns_an_index(tmp_path):
    import subprocess
    import sys

    with sarp.open(tmp_path / "ix"):
        code = f"import sarp; sarp.open({str(tmp_path / 'ix')!r})"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode != 0 and "IndexLockedError" in out.stderr


def test_bad_tunables_are_refused(tmp_path):
    with pytest.raises(ValueError, match="segment_blocks"):
        sarp.open(tmp_path / "a", segment_blocks=0)
    with pytest.raises(ValueError, match="durability"):
        sarp.open(tmp_path / "b", durability="fast")


def test_numpy_signed_and_bytes_hashes_address_the_same_blocks(index):
    big = 2**64 - 3
    index.insert(np.array([big - 2**64, 5], np.int64), holder="w0")
    assert index.match([big, 5]).num_blocks == 2
    assert index.match([big.to_bytes(8, "big"), (5).to_bytes(8, "big")]).num_blocks == 2
    index.insert([6], parent=big.to_bytes(32, "big"), holder="w0")  # parent as bytes
    assert index.match(np.array([big, 6], np.uint64)).num_blocks == 2
    # 6 is stored after `big`, not after 5: a query that puts it there does not match it.
    assert index.match(np.array([big, 5, 6], np.uint64)).num_blocks == 2


def test_a_branch_just_before_a_segment_end_keeps_the_new_chain_inline(tmp_path):
    # The Mooncake pattern: the next turn re-hashes the previous turn's last block.
    with sarp.open(tmp_path / "ix", segment_blocks=8, durability="nosync") as ix:
        ix.insert([1, 2, 3, 4, 5, 6], holder="w0", meta=[10, 20, 30, 40, 50, 60])
        ix.insert([9, 10], parent=4, holder="w1")  # branch: [5, 6] is a short dead end
        new_turn = ix.match([1, 2, 3, 4, 9, 10])
        assert new_turn.num_blocks == 6 and new_turn.storage_reads == 1
        assert new_turn.by_holder == {"w0": 4}
        old_turn = ix.match([1, 2, 3, 4, 5, 6], with_meta=True)
        assert old_turn.num_blocks == 6 and old_turn.storage_reads == 2
        assert old_turn.meta[("w0", "GPU")].tolist() == [10, 20, 30, 40, 50, 60]
        assert ix.stats()["segments"] == 2
        assert ix.check() == []
        # A branch far from the end does not move the long continuation.
        ix.insert([11], parent=1, holder="w1")
        assert ix.match([1, 2, 3, 4, 9, 10]).storage_reads == 1
        assert ix.check() == []


@pytest.mark.parametrize("holder, words", [
    ("x" * 201, "at most 200"),
    ("\ud800", "UTF-8"),
])
def test_holder_names_too_long_or_not_text_get_a_clear_value_error(tmp_path, holder, words):
    with sarp.open(tmp_path / "ix") as index:
        with pytest.raises(ValueError, match=words):
            index.insert([1], holder=holder)
        with pytest.raises(ValueError, match=words):
            index.insert([1], holder="ok", medium=holder)
        assert index.holders_list() == []


def test_a_second_writer_is_refused_even_when_sarp_lock_was_deleted(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "ix"
    with sarp.open(path) as writer:
        writer.insert([1], holder="a")
        (path / "sarp.lock").unlink()  # what a stale-lock cleanup script does
        out = subprocess.run([sys.executable, "-c", f"import sarp; sarp.open({str(path)!r})"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "IndexLockedError" in out.stderr
        assert "sarp.lock deleted" in out.stderr
        writer.insert([2], parent=1, holder="a")
    with sarp.open(path) as index:
        assert index.match([1, 2]).num_blocks == 2


def test_a_large_write_into_a_small_map_grows_the_map_as_needed(tmp_path):
    with sarp.open(tmp_path / "ix", map_size_bytes=1 << 20, durability="nosync") as index:
        assert index.insert(np.arange(1, 400_001, dtype=np.uint64), holder="a") == 400_000
        assert index.match(np.arange(1, 400_001, dtype=np.uint64)).num_blocks == 400_000


def test_holder_ids_of_holders_that_hold_nothing_are_reused_when_all_are_taken(
        tmp_path, monkeypatch):
    import multiprocessing as mp

    from test_readers import reader_main

    import sarp.store

    monkeypatch.setattr(sarp.store, "MAX_HOLDERS", 4)  # instead of 65,536
    path = tmp_path / "ix"
    with sarp.open(path, durability="nosync") as index:
        for i, name in enumerate("abcd"):
            index.insert([10 * i + 1, 10 * i + 2], holder=name)
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        reader = ctx.Process(target=reader_main, args=(str(path), there), daemon=True)
        reader.start()
        try:
            here.send([[1, 2]])
            assert here.recv() == [{"a": 2}]
            with pytest.raises(sarp.StoreFullError, match="clear the ones"):
                index.insert([100], holder="e")
            index.clear("a")  # an engine gone: its holder holds nothing now
            index.insert([100, 101], holder="e")  # takes a's id
            assert ("a", "GPU") not in index.holders_list()
            assert index.match([100, 101]).by_holder == {"e": 2}
            assert index.match([1, 2]).num_blocks == 0
            assert index.match([11, 12]).by_holder == {"b": 2}
            here.send([[100, 101], [1, 2]])  # a reader open all along sees the rename
            assert here.recv() == [{"e": 2}, {}]
            assert index.check() == []
        finally:
            here.send(None)
            reader.join(timeout=20)
    with sarp.open(path) as index:
        assert index.match([100, 101]).by_holder == {"e": 2}


def test_a_write_the_filesystem_refuses_is_store_full_and_changes_nothing(tmp_path):
    # A file-size limit (ulimit -f) stands in for a full disk: LMDB sees its write fail.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import resource, signal, sarp
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        index = sarp.open({str(tmp_path / "ix")!r})
        index.insert(list(range(1, 100)), holder="a")
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, hard))
        stored, k = 99, 0
        try:
            while True:
                chain = list(range(1000 + k * 1000, 2000 + k * 1000))
                index.insert(chain, holder="a")
                stored, k = stored + 1000, k + 1
        except sarp.StoreFullError as exc:
            print("full:", exc)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        assert index.stats()["blocks"] == stored and index.check() == []
        index.insert([10**9], holder="a")  # usable again once there is room
        assert index.match([10**9]).num_blocks == 1
        index.close()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "full:" in out.stdout and "ulimit" in out.stdout and out.stdout.endswith("ok\n")


def test_match_many_equals_match_for_long_and_short_chains_mixed(tmp_path):
    # chains longer than match_many's one-at-a-time threshold beside short ones
    from test_model import same_match

    rng = np.random.default_rng(3)
    with sarp.open(tmp_path / "ix", durability="nosync", segment_blocks=64) as index:
        trunk = rng.integers(1, 2**63, 900, dtype=np.uint64)
        index.insert(trunk, holder="a", medium="GPU")
        index.insert(trunk[:500], holder="b", medium="CPU")
        branch = rng.integers(1, 2**63, 400, dtype=np.uint64)
        index.insert(branch, parent=int(trunk[299]), holder="b", medium="GPU")
        index.remove(trunk[600:610], holder="a", medium="GPU")
        queries = [trunk, trunk[:20], np.concatenate([trunk[:300], branch]), trunk[:5],
                   np.concatenate([trunk[:700], branch[:3]]), branch, trunk[:290]]
        many = index.match_many(queries, with_meta=True, with_presence=True)
        for q, got in zip(queries, many, strict=True):
            assert same_match(got, index.match(q, with_meta=True, with_presence=True))
        assert [m.num_blocks for m in many] == [600, 20, 700, 5, 600, 0, 290]


def test_reinserting_a_chain_around_a_segment_that_outlived_its_parent(tmp_path):
    """A store walks from its parent; here the blocks before a surviving segment are
    gone, so the walk cannot reach it and the insert must still find and reuse it."""
    with sarp.open(tmp_path / "ix", segment_blocks=4) as index:
        index.insert([1, 2, 3, 4], holder="a")
        index.insert([5, 6], parent=4, holder="b")  # its own segment: the first is full
        index.remove([4, 3, 2, 1], holder="a")  # that segment goes; [5, 6] stays
        segments = index.stats()["segments"]
        assert index.insert([1, 2, 3, 4, 5, 6, 7], holder="c") == 5  # 5 and 6 were stored
        assert index.stats()["segments"] == segments + 1  # 7 went after 6, in its segment
        assert index.match([1, 2, 3, 4, 5, 6, 7]).by_holder == {"c": 7}
        assert "b" not in index.match([1, 2, 3, 4, 5, 6]).by_holder  # b holds no prefix
        assert index.check() == []


def test_meta_of_blocks_another_holder_stored_first(tmp_path):
    """A store that re-stores others' blocks (found by walking segments) and extends
    them keeps each holder's own meta for each block."""
    with sarp.open(tmp_path / "ix", segment_blocks=4) as ix:
        ix.insert(chain(1, 6), holder="w0", meta=[10, 11, 12, 13, 14, 15])
        ix.insert(chain(3, 6), parent=2, holder="w1", meta=[23, 24, 25, 26, 27, 28])  # 7, 8 new
        ix.insert(chain(1, 2), holder="w1", meta=[21, 22])
        m = ix.match(chain(1, 8), with_meta=True)
        assert m.num_blocks == 8 and m.by_holder == {"w0": 6, "w1": 8}
        assert m.meta[("w0", "GPU")].tolist() == [10, 11, 12, 13, 14, 15]
        assert m.meta[("w1", "GPU")].tolist() == [21, 22, 23, 24, 25, 26, 27, 28]
        assert ix.check() == []


def test_a_writer_changes_memory_only_under_its_memory_lock(tmp_path):
    """A writer's memory (what serve's HTTP thread reads in C between commits) changes
    only under ``Memory.lock``: a commit's changes and the watermark after it, and a
    snapshot's merge of the directory, wait while another thread holds it; the write
    itself does not (the commit is on disk meanwhile)."""
    import threading

    with sarp.open(tmp_path / "ix") as ix:
        ix.insert([1, 2, 3], holder="w0")
        memory = ix.reading().memory
        for work in (lambda: ix.insert([4, 5], parent=3, holder="w0"),
                     lambda: ix.insert([6], holder="w1"), ix.snapshot):
            before = (memory.watermark, len(memory.directory), memory.directory.keys.size)
            done = threading.Event()
            with memory.lock:
                t = threading.Thread(target=lambda w=work, d=done: (w(), d.set()))
                t.start()
                assert not done.wait(0.3)  # waiting for the lock ...
                assert (memory.watermark, len(memory.directory),
                        memory.directory.keys.size) == before  # ... memory as it was
            t.join(10)
            assert done.is_set()
        assert memory.watermark == ix.reading().store.counter("next_seq") > 0
        assert ix.match([1, 2, 3, 4, 5]).num_blocks == 5
