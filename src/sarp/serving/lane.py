"""The in-line lane: an engine's live messages that come next in its sequence, taken
from its SUB socket and decoded into the commit's columns in one C call
(``sarp._native.take_line``), with no Python object per frame.

In a backlog most messages are next in line: sequence ``expected``, then the one
after, ...  For those the subscriber's per-message work in Python (receiving each
frame through pyzmq, parsing the frames, decoding, the digest, the fingerprint) was
about a quarter of a drain's CPU.  The lane takes up to ``count`` of them at once, each
decoded into the commit's columns (:class:`sarp.serving.columns.Columns`) and kept
only while it stays in line: its sequence the next, its timestamp not gone back more
than ``slack`` (the first not before ``ts_floor``), its dp_rank the source's.  The
first message that is not in line (another sequence, another shape, a clear, a rank
or a time that differs, a malformed frame) is handed back whole, as pyzmq would have
received it, for the subscriber's own rules; nothing of it is in the columns.

The C calls libzmq itself: the library pyzmq's extension loaded (found with ctypes,
:func:`libzmq_calls`), on pyzmq's own socket (``Socket.underlying``), only through
libzmq 4's stable C API.  :class:`Lane` checks the whole path once per process on
an inproc pair before it is used, and without the extension, or with a libzmq it
cannot find or that fails the check, there is no lane (``Lane.open`` is None) and
every message goes the subscriber's Python way.  :func:`take_line_python` is the
reference the C is tested against (tests/test_lane.py).

While the subscriber commits, :class:`Prefetch` takes on the same way from every
source in line, on a thread of its own without the GIL (``lane_prefetch``), into
columns of its own: the decoding of the next commit's messages runs on the other core
while this one's is written.  It learns no name: a (holder, medium) pair or a LoRA
name the columns have not met leaves its message out of line, for the subscriber.
:func:`prefetch_python` is its reference.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

import zmq

from .. import native
from ..hashing import checksum
from .columns import Columns, NotLearnt
from .replay import parse_frames, recv_message

log = logging.getLogger("sarp.lane")

TAKEN_ALL, DRY, NOT_IN_LINE, RECV_FAILED = 0, 1, 2, 3  # take_line's status
Taken = tuple[int, list[int], list[float], int, int, "list[bytes] | None"]
_CALLS = ("zmq_msg_init", "zmq_msg_recv", "zmq_msg_data", "zmq_msg_size", "zmq_msg_more",
          "zmq_msg_close", "zmq_errno")
# msgpack of [1.5, [["BlockStored", [7, 8], None, [], 16, None, "GPU"]]]: the check's batch
_CHECK_PAYLOAD = (b"\x92\xcb?\xf8\x00\x00\x00\x00\x00\x00\x91\x97\xabBlockStored\x92\x07\x08"
                  b"\xc0\x90\x10\xc0\xa3GPU")


def libzmq_calls() -> tuple[int, ...] | None:
    """The addresses of libzmq's message calls (``_CALLS``) in the library pyzmq's
    extension loaded, or None: a libzmq before 4.1 (another ``zmq_msg_t``), or a
    pyzmq whose extension cannot be opened by its path (its CFFI backend).

    >>> calls = libzmq_calls()
    >>> calls is None or len(calls) == 7
    True
    """
    if zmq.zmq_version_info() < (4, 1):
        return None
    socket_class = getattr(zmq.backend, "Socket", None)
    path = getattr(sys.modules.get(getattr(socket_class, "__module__", "")), "__file__", None)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # loaded already: its handle; libzmq is its dependency
        return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _CALLS)
    except (OSError, AttributeError):
        return None


class Lane:
    """The C lane, once the process's check passed; see the module docstring.

    ``Lane.open()`` is the lane, or None (no extension, no libzmq found, the check
    failed: logged once).  Cost: a C call per ``count`` messages, about a microsecond
    of C per event decoded.

    >>> lane = Lane.open()
    >>> lane is None or isinstance(lane, Lane)
    True
    """

    _checked: bool | None = None
    _lock = threading.Lock()

    @classmethod
    def open(cls) -> Lane | None:
        with cls._lock:
            if cls._checked is None:
                cls._checked = cls._bind_and_check()
        return cls() if cls._checked else None

    @staticmethod
    def _bind_and_check() -> bool:
        if native.C is None:
            return False
        calls = libzmq_calls()
        if calls is None or None in calls:
            log.info("sarp: libzmq's C calls not found; live messages go one by one")
            return False
        try:
            native.C.lane_bind(calls)
            ok = _check(Lane())
        except Exception as exc:  # noqa: BLE001 - a lane that fails its check is not used
            ok, why = False, repr(exc)
        else:
            why = "its answers differ from the reference's"
        if not ok:
            log.warning("sarp: the C lane failed its check (%s); live messages go one by one",
                        why)
        return ok

    def take(self, sock: zmq.Socket, count: int, expected: int, ts_floor: float, slack: float,
             tokens: bool, root: int | None, holder: str, rank: int | None, rank_fixed: bool,
             columns: Columns) -> Taken:
        """:func:`take_line_python`'s answer, from C."""
        return native.C.take_line(sock.underlying, count, expected, ts_floor, slack, tokens,
                                  root or 0, columns.holder_number(holder), rank, rank_fixed,
                                  columns.ctx)


class Prefetch:
    """Takes from the sources in line (``lines``: :meth:`Lane.take`'s arguments from the
    socket on, without count and columns) on a thread of its own: round after round,
    up to ``count`` messages from each, until each has stopped (dry, out of line) or
    ``max_events`` were taken, or :meth:`end`.  The sockets are the thread's until then.

    Cost: a thread's start and join; about a microsecond of C per event, off the
    caller's thread, and a copy of the columns at :meth:`end`.

    >>> Lane.open() is None or Prefetch.start([], 8, 100, Columns()).end(Columns()) == []
    True
    """

    def __init__(self, handle, lines: list[tuple]) -> None:
        self._handle, self._lines = handle, lines

    @classmethod
    def start(cls, lines: list[tuple], count: int, max_events: int,
              columns: Columns) -> Prefetch | None:
        """Start it, with the names and LoRA seeds ``columns`` have learnt (None: the
        columns forget them at their next take, so not now)."""
        learnt = columns.learnt()
        if learnt is None:
            return None
        pairs, seeds = learnt
        handle = native.C.lane_prefetch(
            [(sock.underlying, expected, floor, slack, tokens, root or 0,
              columns.holder_number(holder), rank, rank_fixed)
             for sock, expected, floor, slack, tokens, root, holder, rank, rank_fixed in lines],
            count, max_events, pairs, seeds)
        return cls(handle, lines)

    def end(self, columns: Columns, wait: bool = False) -> list[tuple[int, int, int, Taken]]:
        """Stop it (``wait``: let it finish first) and append what it took to
        ``columns``: per take, in the order taken, ``(line, expected, first row,
        take_line's answer)``."""
        first = len(columns)
        takes = native.C.lane_prefetch_end(self._handle, columns.ctx, wait)
        out, expected = [], [line[1] for line in self._lines]
        for j, rows, taken in takes:
            out.append((j, expected[j], first, taken))
            expected[j] += len(taken[1])
            first += rows
        return out

    def drop(self) -> None:
        """Stop it and drop what it took (those messages are lost: a gap)."""
        native.C.lane_prefetch_end(self._handle, None, False)


def prefetch_python(lines: list[tuple], count: int, max_events: int,
                    columns: Columns) -> list[tuple[int, int, int, Taken]]:
    """The reference of :class:`Prefetch`, run to its end at once: the same takes,
    decoded with only what ``columns`` have learnt, appended to them."""
    scratch = columns.copy(learning=False)
    out, expected = [], [line[1] for line in lines]
    floors = [line[2] for line in lines]
    done, events = [False] * len(lines), 0
    while not all(done) and events < max_events:
        for j, (sock, _, _, slack, *rest) in enumerate(lines):
            if done[j]:
                continue
            first = len(scratch)
            got = take_line_python(sock, count, expected[j], floors[j], slack, *rest, scratch)
            done[j] = got[0] != TAKEN_ALL
            if got[1] or got[0] == NOT_IN_LINE:
                out.append((j, expected[j], len(columns) + first, got))
                events += got[3]
            expected[j] += len(got[1])
            floors[j] = got[2][-1] - slack if got[2] else floors[j]
    columns.extend(scratch)
    return out


def take_line_python(sock: zmq.Socket, count: int, expected: int, ts_floor: float,
                     slack: float, tokens: bool, root: int | None, holder: str,
                     rank: int | None, rank_fixed: bool, columns: Columns) -> Taken:
    """Up to ``count`` messages in line from ``sock`` into ``columns`` (the reference of
    ``take_line``): ``(status, digests, stamps, events, skipped, frames)``, status one
    of ``TAKEN_ALL``, ``DRY`` (no more waiting), ``NOT_IN_LINE`` (``frames``: the
    message after those taken, none of it in the columns), ``RECV_FAILED`` (pyzmq's
    ``recv`` raises why); ``digests`` and ``stamps``: the payloads' xxh3-64 and
    timestamps of the messages taken; ``events`` and ``skipped``: their events and
    those of another KV cache group (:meth:`Columns.add`).
    """
    digests: list[int] = []
    stamps: list[float] = []
    events = skipped = 0
    for k in range(count):
        try:
            frames = recv_message(sock.recv)
        except zmq.Again:
            return DRY, digests, stamps, events, skipped, None
        except zmq.ZMQError:
            return RECV_FAILED, digests, stamps, events, skipped, None
        parsed = parse_frames(frames)
        got = None
        if parsed is not None and parsed[0] == expected + k:
            mark = columns.mark()
            try:
                got = columns.add(parsed[1], holder, root, tokens=tokens)
            except NotLearnt:  # (a prefetch's columns, learning nothing)
                columns.rollback(mark)
                got = None
            if got is not None and (got[0] < ts_floor or not (
                    got[1] is None or got[1] == rank if rank_fixed else got[1] == rank)):
                columns.rollback(mark)
                got = None
        if got is None:
            return NOT_IN_LINE, digests, stamps, events, skipped, frames
        digests.append(checksum(parsed[1]))
        stamps.append(got[0])
        events, skipped = events + got[2], skipped + got[3]
        ts_floor = got[0] - slack
    return TAKEN_ALL, digests, stamps, events, skipped, None


def _check(lane: Lane) -> bool:
    """The lane and the reference agree on a pair of inproc sockets: two messages in
    line, one out of line, then none."""
    context = zmq.Context()
    sockets: list[zmq.Socket] = []
    try:
        answers = []
        for n, take in enumerate((lane.take, take_line_python)):
            push, pull = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
            sockets += [push, pull]
            push.bind(f"inproc://sarp-lane-check-{n}")
            pull.connect(f"inproc://sarp-lane-check-{n}")
            for seq in (5, 6, 9):
                push.send_multipart([b"kv", seq.to_bytes(8, "big"), _CHECK_PAYLOAD])
            columns = Columns()
            got = [take(pull, 3, 5, 0.0, 1.0, False, None, "e#0", None, False, columns),
                   take(pull, 3, 10, 0.0, 1.0, False, None, "e#0", None, False, columns)]
            answers.append((got, columns.take().hashes.tolist()))
        return answers[0] == answers[1] and answers[0][0][0][0] == NOT_IN_LINE
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()
