"""A Valkey reader's match in one C call (``sarp.valkey_read``, ``valkey_read.c``)
against the Python path it mirrors, on a real Valkey server: random chains written
while readers match them (the counters move under the readers, so C hands replies to
the catch-up), several readers matched at once, instances in two media, a reply
refused (the script gone from the server), a damaged record, a connection cut."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from conftest import valkey_server

import sarp
from sarp import native
from sarp.store import U64

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason="sarp._native is not built")


def _url(name: str) -> str:
    return valkey_server().url(f"{name}-{uuid.uuid4().hex[:10]}")


def _answer(m: sarp.Match) -> tuple:
    return (m.num_blocks, m.by_holder, m.by_medium, m.multi_medium,
            {k: v.tolist() for k, v in sorted(m.presence.items())})


def _python(index: sarp.Index, chain: np.ndarray, **kw) -> sarp.Match:
    with native.forced("python"):
        return index.match(chain, **kw)


def _random_chains(rng, count: int) -> list[np.ndarray]:
    """Chains sharing prefixes (branches off a few trunks), as requests do."""
    trunks = [rng.integers(1, 1 << 63, 120, dtype=np.uint64) for _ in range(4)]
    chains = []
    for _ in range(count):
        trunk = trunks[int(rng.integers(0, len(trunks)))]
        cut = int(rng.integers(1, trunk.size))
        tail = rng.integers(1, 1 << 63, int(rng.integers(0, 40)), dtype=np.uint64)
        chains.append(np.concatenate([trunk[:cut], tail]))
    return chains


@pytest.mark.parametrize("seed", range(3))
def test_a_readers_match_in_c_is_the_python_paths_while_the_writer_writes(seed):
    """Each reader's answer in C equals the Python path's on the same state, match by
    match, while a writer inserts and evicts between them (the reply's counters then
    moved: the catch-up takes it over); and ``Index.match_each`` over two readers of
    two namespaces equals their own matches."""
    rng = np.random.default_rng(seed)
    urls = [_url("c-read"), _url("c-read")]
    chains = _random_chains(rng, 60)
    media = ["GPU", "CPU"] if seed == 2 else ["GPU"]  # seed 2: instances in two media
    with sarp.open(urls[0], durability="nosync", segment_blocks=16) as w0, \
            sarp.open(urls[1], durability="nosync", segment_blocks=16) as w1:
        writers = [w0, w1]
        with sarp.open(urls[0], readonly=True) as r0, sarp.open(urls[1], readonly=True) as r1:
            readers = [r0, r1]
            in_c = 0
            for step, chain in enumerate(chains):
                w = writers[step % 2]
                holder, medium = f"e{int(rng.integers(0, 4))}", media[step % len(media)]
                w.insert(chain, holder=holder, medium=medium)
                if step % 3 == 0:
                    victim = chains[int(rng.integers(0, step + 1))]
                    cut = int(rng.integers(0, victim.size))
                    w.remove(victim[cut:][::-1], holder=holder, medium=medium)
                for query in (chain, chains[int(rng.integers(0, step + 1))]):
                    presence = bool(rng.integers(0, 2))  # the per-block tiers, or not
                    before = native.calls()["read_match"][0]
                    got = [r.match(query, with_presence=presence) for r in readers]
                    in_c += native.calls()["read_match"][0] - before
                    assert [_answer(m) for m in got] == \
                        [_answer(_python(r, query, with_presence=presence)) for r in readers]
                    assert [_answer(m) for m in got] == \
                        [_answer(w.match(query, with_presence=presence)) for w in writers]
                    both = sarp.Index.match_each(readers, query, with_presence=presence)
                    assert [_answer(m) for m in both] == [_answer(m) for m in got]
            assert in_c > 0  # C answered (or handed over) the matches it could take


def test_a_reply_refused_or_a_damaged_record_falls_back_to_the_python_path():
    """The READ script flushed from the server (NOSCRIPT): C hands the error back and
    the Python path loads the script again and answers.  A record damaged in the
    store: the answer is the Python path's (the prefix verified before it), and the
    damage is counted."""
    url = _url("c-fallback")
    chain = np.arange(1, 81, dtype=np.uint64)
    with sarp.open(url, segment_blocks=16) as writer:
        writer.insert(chain, holder="a")
        with sarp.open(url, readonly=True) as reader:
            assert reader.match(chain).by_holder == {"a": 80}
            writer._store.client.script_flush()
            assert reader.match(chain).by_holder == {"a": 80}  # refused, then asked again
            before = native.calls()["read_match"][0]
            assert reader.match(chain).by_holder == {"a": 80}
            assert native.calls()["read_match"][0] == before + 1  # C again, script loaded
            seg_id = reader.directory.lookup(int(chain[32]))
            key, table = U64.pack(seg_id), writer._store.keys["seg"]
            record = bytearray(writer._store.client.hget(table, key))
            record[30] ^= 0xFF
            writer._store.client.hset(table, key, bytes(record))
            damaged = reader.stats()["corrupt_records"]
            assert reader.match(chain).by_holder == {"a": 32}
            assert reader.stats()["corrupt_records"] == damaged + 1  # counted, and logged
            assert _answer(reader.match(chain)) == _answer(_python(reader, chain))


def test_a_reply_c_reads_after_a_write_is_the_catch_ups_read():
    """When the writer wrote since the reader's last look, C's read is handed to the
    catch-up as its first read (not asked again): the match makes two reads, that one
    and the one after the catch-up, as the Python path does; with nothing written, one."""
    from sarp.bench.valkey_server import ValkeyServer

    chain = np.arange(1, 65, dtype=np.uint64)
    with ValkeyServer() as server, \
            sarp.open(server.url("handover"), segment_blocks=16, lease_s=60) as writer:
        url = server.url("handover")  # (a server of its own: its command counts are ours)
        writer.insert(chain[:32], holder="a")
        client = writer._store.client

        def reads() -> int:
            return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

        with sarp.open(url, readonly=True) as reader:
            assert reader.match(chain).by_holder == {"a": 32}
            before = reads()
            assert reader.match(chain).by_holder == {"a": 32}
            assert reads() - before == 1
            writer.insert(chain[32:], parent=int(chain[31]), holder="a")
            before = reads()
            assert reader.match(chain).by_holder == {"a": 64}
            assert reads() - before == 2


def test_readers_matched_together_in_any_order_from_two_threads():
    """``match_each`` takes its readers' locks in one order whatever the order given:
    two threads matching the same two readers in opposite orders both finish, with
    each reader's own answers."""
    import threading

    urls = [_url("c-order"), _url("c-order")]
    chain = np.arange(1, 33, dtype=np.uint64)
    with sarp.open(urls[0]) as w0, sarp.open(urls[1]) as w1:
        w0.insert(chain, holder="a")
        w1.insert(chain[:16], holder="b")
        r0, r1 = sarp.open(urls[0], readonly=True), sarp.open(urls[1], readonly=True)
        answers: list[list] = []

        def run(readers):
            got = [sarp.Index.match_each(readers, chain) for _ in range(200)]
            answers.append([str([m.by_holder for m in ms]) for ms in got])

        threads = [threading.Thread(target=run, args=(order,), daemon=True)
                   for order in ([r0, r1], [r1, r0])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        # (deadlocked, the readers' locks are held: closing them would wait forever)
        assert not any(t.is_alive() for t in threads), "deadlocked"
        r0.close()
        r1.close()
        assert [len(set(got)) for got in answers] == [1, 1]  # each thread: one answer
        assert sorted(got[0] for got in answers) == sorted(
            [str([{"a": 32}, {"b": 16}]), str([{"b": 16}, {"a": 32}])])


def _resp(*items) -> bytes:
    """RESP2 bytes: bytes as bulk strings, None as nil, lists as arrays."""
    out = b""
    for item in items:
        if item is None:
            out += b"$-1\r\n"
        elif isinstance(item, list):
            out += b"*%d\r\n" % len(item) + _resp(*item)
        else:
            out += b"$%d\r\n%s\r\n" % (len(item), item)
    return out


def test_read_match_reads_a_reply_in_pieces_and_refuses_what_is_not_reads(tmp_path):
    """``read_match`` against a peer on a socket pair (the Valkey node's side played by
    the test): the READ it sends, a reply arriving a byte at a time (walked as the
    records' own index walks them), RESP3's null, counters that moved (the reply handed
    back), an error reply, and the faults: a reply of another shape, the peer gone, no
    reply in time.  Each fault is an exception the caller turns into the Python path."""
    import socket
    import threading
    import time

    chain = np.arange(1, 41, dtype=np.uint64)
    with sarp.open(tmp_path / "ix", segment_blocks=16) as index:
        index.insert(chain, holder="a")
        want = index.match(chain)
        directory = index.directory
        segs = [directory.lookup(int(chain[k])) for k in (0, 16, 32)]
        with index._store.read() as r:
            records = r.raw_records(segs)
    index_id, seq = b"I" * 16, 7
    meta = [b"index_id", index_id, b"next_seq", seq.to_bytes(8, "big")]

    def ask(reply: bytes, *, piece: int = 1 << 20, gap_s: float = 0.0, timeout_ms: int = 5000,
            close: bool = False, rows: bool = False):
        a, b = socket.socketpair()
        a.setblocking(False)
        sent = []

        def node():
            sent.append(b.recv(1 << 16))
            for i in range(0, len(reply), piece):
                b.sendall(reply[i:i + piece])
                time.sleep(gap_s)
            if close:
                b.close()

        peer = threading.Thread(target=node, daemon=True)
        peer.start()
        try:
            shard = (a.fileno(), b"HEAD", index_id, seq, *directory.native_arrays())
            got = list(native.C.read_match(chain, [shard], timeout_ms, rows))
            peer.join(timeout=10)
            with pytest.raises(BlockingIOError):
                a.recv(16)  # nothing of the reply left unread on the connection
            return got, sent
        finally:
            peer.join(timeout=10)
            a.close()
            b.close()

    answers, sent = ask(_resp([meta, records]), piece=1)
    keys = b"".join(b"$8\r\n%s\r\n" % s.to_bytes(8, "big") for s in segs)
    assert sent == [b"*8\r\nHEAD" + keys]  # EVALSHA's 5 fixed arguments, then the keys
    total, reads, runs, stopped = answers[0]
    assert (total, reads, stopped) == (want.num_blocks, 3, -1) and len(runs) == 1
    (rows,), _ = ask(_resp([meta, records]), rows=True)
    assert rows[0] == 40 and [bytes(v) for v in rows[2].values()] == [b"\x01" * 40]
    nulls = _resp([meta, []])[:-4] + b"*3\r\n_\r\n_\r\n_\r\n"  # RESP3's null for each
    assert ask(nulls)[0] == [(0, 1, {}, -1)]  # the first record gone: nothing held
    moved = [b"index_id", index_id, b"next_seq", (seq + 1).to_bytes(8, "big")]
    assert ask(_resp([moved, records]))[0] == [("reply", moved, records)]
    assert ask(b"-NOSCRIPT No matching script\r\n", piece=1, gap_s=0.002)[0] == [
        ("error", b"NOSCRIPT No matching script")]  # (its last byte read too)
    with pytest.raises(ValueError, match="shape"):  # two records for three keys
        ask(_resp([meta, records[:2]]))
    with pytest.raises(ConnectionResetError):  # the node went away mid-reply
        ask(_resp([meta, records])[:50], close=True)
    with pytest.raises(TimeoutError):
        ask(b"", timeout_ms=200)
