"""``sarp serve``: follow engines' KV events into an index on disk until SIGTERM.

With ``--http HOST:PORT`` it also starts HTTP worker processes that answer queries
from readonly opens of the same index (:mod:`sarp.serving.http`); this process
stays the one writer and keeps a status file the workers report from.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StoreError
from ..tokenkeys import DEFAULT_TENANT
from .sources import ReplayBudget, Source, load_sources, read_sources_file, save_sources

if TYPE_CHECKING:
    from .subscriber import Subscriber

log = logging.getLogger("sarp.serve")

STATUS_EVERY_S = 0.5
# A snapshot at the first idle poll after this many segment changes, or a tenth of the
# directory's entries if more (at most one a second), besides --snapshot-every-s: a
# restart after a burst then loads it and replays a short log, where it rebuilt the
# directory from every segment (0.13 s at 10,000 segments, in serve and in each worker).
IDLE_SNAPSHOT_CHANGES = 1000
QUIET_SNAPSHOT_S = 2.0  # ... and after any change, once the last is this old
# Under a stream that never lets serve idle: a snapshot once the log after the last
# has this many segment changes, or the directory's entries if more (looked at once a
# second).  A restart's first answers replay that log at 1.3-2.1 µs a change before
# they answer (serving/first.py): at most 0.1 s, where the index's own rule
# (snapshot_every_changes, 200,000) let 0.3-0.4 s pile up (140,068 changes: 0.22 s);
# a snapshot costs a pass over the directory, so at most an entry's work per change.
BUSY_SNAPSHOT_CHANGES = 50_000
TRIM_EVERY_S = 1.0  # freed heap memory handed back at most this often (_trim_malloc) ...
TRIM_AFTER_BATCHES = 1_000  # ... or at once after a backlog of this many batches
# Python's collector looks for cycles in the young objects after every YOUNG_OBJECTS
# allocations net (700 by default): the subscriber's loop makes a few dozen short-lived
# objects per event, and almost no cycles.
YOUNG_OBJECTS = 50_000


class SnapshotRule:
    """When serve writes the directory snapshot: every ``every_s``; at an idle poll
    after work (at most once a second) once the work changed a tenth of the directory
    or :data:`IDLE_SNAPSHOT_CHANGES`, or anything once the last is
    :data:`QUIET_SNAPSHOT_S` old; and while busy (looked at once a second) once the log
    after the last has :data:`BUSY_SNAPSHOT_CHANGES` changes or the directory's entries.
    ``stats`` is :meth:`sarp.Index.stats`, called only at those looks; a store that is
    away (:class:`StoreError`) means not now.  :meth:`due` says which: :data:`BUSY`
    (the snapshot keeps the log: a trim past the HTTP workers while they answer would
    have them load the snapshot again), :data:`DUE` (it trims the log), or "" (none).

    >>> rule = SnapshotRule(60.0, now=0.0, rebuilt=False)
    >>> stats = lambda: {"changes_since_snapshot": 60_000, "directory_entries": 9_000}
    >>> rule.due(0.5, 10, stats), rule.due(1.5, 10, stats), rule.due(60.0, 10, stats)
    ('', 'busy', 'due')
    """

    DUE, BUSY = "due", "busy"

    def __init__(self, every_s: float, now: float, rebuilt: bool) -> None:
        self.every_s = every_s
        self.last = self.last_look = now
        # a directory rebuilt at open is snapshotted at the first idle poll
        self.busy = int(rebuilt)  # work applied since the last snapshot

    def due(self, now: float, applied: int, stats: Callable[[], dict]) -> str:
        self.busy += applied
        due = now - self.last >= self.every_s
        if self.busy and not applied and now - self.last >= 1.0:
            # idle after work: a snapshot costs a pass over the directory, so after a
            # tenth of it changed; after any change once the last is QUIET_SNAPSHOT_S
            # old (a restart's first answers replay the log after it: serving/first.py)
            with contextlib.suppress(StoreError):
                got = stats()
                changed = got["changes_since_snapshot"]
                due = due or changed >= max(IDLE_SNAPSHOT_CHANGES,
                                            got["directory_entries"] // 10) or (
                    changed > 0 and now - self.last >= QUIET_SNAPSHOT_S)
                if not changed:
                    self.busy = 0
        elif applied and now - self.last_look >= 1.0 and not due:  # has the log grown?
            self.last_look = now
            with contextlib.suppress(StoreError):
                got = stats()
                if got["changes_since_snapshot"] >= max(BUSY_SNAPSHOT_CHANGES,
                                                        got["directory_entries"]):
                    return self.BUSY
        return self.DUE if due else ""

    def taken(self, now: float) -> None:
        """A snapshot was written (or tried: a failed one waits for the next period)."""
        self.last, self.busy = now, 0


@contextmanager
def collector_tuned() -> Iterator[None]:
    """Run the subscriber's loop with Python's collector set for it, then put it back.

    What the process holds when the loop starts (modules, the index's memory) stays
    for its life, so ``gc.freeze`` takes it out of every later collection; and the
    young generation is collected every ``YOUNG_OBJECTS`` allocations instead of 700.
    A backlog drained 36,823 -> 40,559 events/s on Mooncake and 37,316 -> 38,518 on
    the built-in workload (medians of 4, interleaved; docs/performance.md).  For
    ``sarp serve``'s process, and for ``bench-events``, which measures the loop as
    serve runs it; a library user's process is theirs to tune.

    Cost: one full collection at the start.

    >>> import gc
    >>> with collector_tuned():
    ...     gc.get_threshold()[0] == YOUNG_OBJECTS
    True
    """
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    # the older generations at 20 and 100 young collections, as measured
    gc.set_threshold(YOUNG_OBJECTS, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def run(args: argparse.Namespace, zygote=None) -> int:
    """``sarp serve``.  ``zygote``: the HTTP workers' (``workers.start_zygote``),
    forked by the command line before this module was imported; made here when None.
    Whatever fails, the zygote is stopped and its metrics folder removed."""
    dealer = None
    try:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        _more_descriptors()
        sources = _flagged(args)
        if args.sources_file:
            read_sources_file(args.sources_file, args.dp_ranks)  # a bad file: refused
        if args.http:
            from .access import access_token, parse_address
            from .workers import ConnectionDealer, default_workers, start_zygote

            if args.http_workers is None:
                args.http_workers = default_workers()
            if args.http_workers < 0:
                raise ValueError(f"--http-workers {args.http_workers}: pass 0 (HTTP on a "
                                 "thread of serve's own) or more (worker processes)")
            if args.http_workers == 0 and ("://" in str(args.index)
                                           or getattr(args, "shard", None) is not None):
                raise ValueError("--http-workers 0 answers from serve's own index, a folder's; "
                                 "on Valkey or with --shard, pass 1 or more")
            host, port = parse_address(args.http)
            args.http_token = access_token(args.http, args.http_token_file,
                                           args.http_allow_unauthenticated)
            # forked while serve is its imports and nothing else (no thread, no index)
            zygote = zygote or start_zygote(args.http_workers)
            # listen before the index opens: a port in use stops serve, nothing changed
            early = getattr(args, "early", None)
            dealer = ConnectionDealer(host, port, max(1, args.http_workers), zygote.heartbeats,
                                      early.answers if early is not None else None)
        return _signalled(args, sources, dealer, zygote)
    finally:
        if dealer is not None:
            dealer.close()
        if zygote is not None:
            zygote.close()
            shutil.rmtree(zygote.metrics_dir, ignore_errors=True)


def _signalled(args, sources: list[Source], dealer, zygote) -> int:
    stop = {"now": False, "looping": False}

    def on_signal(signum, _frame) -> None:
        log.info("signal %d: stopping after the current batch", signum)
        stop["now"] = True
        if not stop["looping"]:
            # opening the index, waiting for a lease, starting workers: nothing is
            # half-applied there, so stop at once (SIGTERM within 2 s in every state)
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    on_valkey = "://" in args.index
    lease = {"lease_s": args.lease_s, "wait_for_lease_s": args.wait_for_lease_s} \
        if on_valkey else {}
    if on_valkey and args.wait_for_lease_s:
        log.info("waiting up to %.0f s for the writer lease of %s", args.wait_for_lease_s,
                 args.index)
    return _run(args, sources, dealer, zygote, stop, on_valkey, lease)


def _run(args, sources: list[Source], dealer, zygote, stop: dict, on_valkey: bool,
         lease: dict) -> int:
    # imported after the HTTP zygote is forked (ZeroMQ, the decoder): the zygote
    # imports what the workers need meanwhile, on the other core
    import sarp

    from .hashcheck import HashCheck
    from .subscriber import COMMIT_WAIT_MS, Subscriber

    http = dealer is not None
    # the HTTP workers' status file: beside a folder index, in a folder of ours for Valkey
    status_dir = tempfile.mkdtemp(prefix="sarp-status-") if on_valkey else args.index
    # with HTTP, engines may all come by /register (as to Dynamo's standalone indexer)
    named = bool(sources or args.sources_file or http)
    try:  # with no engine named, follow the last serve's: the index must exist already
        index = sarp.open(args.index, durability=args.durability, create=named,
                          shard=getattr(args, "shard", None), **lease)
    except sarp.NotAnIndexError:
        if named:
            raise
        raise ValueError("no engine to follow: name them with --source or --sources-file "
                         f"(there is no index at {args.index} whose last serve's engines "
                         "could be followed)") from None
    with index:
        log.info("index %s recovered from %s in %.1f ms; following %s", args.index,
                 index.recovered_from, 1e3 * index.recovery_s, ", ".join(s.key for s in sources))
        sources, registered = _chosen(args, sources, load_sources(index))
        save_sources(index, sources, registered)
        hash_check = HashCheck(args.hash_scheme, args.hash_seed)  # a bad flag: refused here
        service = None
        if http:
            # what a killed serve left says it was caught up: the workers must not
            # answer /readyz from it before this serve has checked the engines
            from .status import write_status

            write_status(Path(status_dir), None, caught_up=False, started=time.time(),
                         engines=sources)
            # the workers open the index and answer while the subscriber is built
            service = _start_http(args, dealer, zygote, status_dir, index)
        try:  # built once the workers are asked for (they start meanwhile)
            early = getattr(args, "early", None)  # the engines' sockets, connected early
            adopt = {} if early is None else early.take_engines(args.max_frame_bytes)
            subscriber = Subscriber(index, sources, adopt=adopt,
                                    replay_idle_timeout_s=args.replay_idle_timeout_s,
                                    probe_after_s=args.probe_after_s or None,
                                    dead_after_s=args.dead_after_s,
                                    max_frame_bytes=args.max_frame_bytes,
                                    replay_budget=ReplayBudget(seconds=args.replay_budget_s),
                                    hash_check=hash_check,
                                    max_sources=getattr(args, "max_engines", None),
                                    commit_wait_ms=getattr(args, "commit_wait_ms",
                                                           COMMIT_WAIT_MS))
        except BaseException:
            if service is not None:
                service.close()
            raise
        try:
            with collector_tuned():
                # the status file: for the workers, and for `sarp stats` beside serve
                _follow(args, index, subscriber, stop,
                        Path(status_dir) if http or not on_valkey else None, service,
                        registered)
        finally:
            subscriber.close()
            if service is not None:
                service.close()
            if on_valkey:
                shutil.rmtree(status_dir, ignore_errors=True)
        log.info("stopped; writing the snapshot")
    return 0


def _follow(args, index, subscriber: Subscriber, stop: dict, path: Path | None,
            service=None, registered: set[str] | None = None) -> None:
    from .status import write_status

    started = time.time()
    files = _OwnFiles()
    with_status = path is not None
    if with_status:
        write_status(path, subscriber, caught_up=False, started=started)
    stop["looping"] = True  # from here a signal only sets the flag: the loop stops
    if stop["now"]:
        return
    # The start-up checks run as jobs the polls feed: an engine whose replay is slow
    # or hostile delays only itself, and SIGTERM is seen within one poll.
    subscriber.start_catch_up()
    last_report = last_status = last_trim = time.monotonic()
    busy_since_trim = 0
    # a directory rebuilt at open is snapshotted at the first idle poll, engines or not
    snapshots = SnapshotRule(args.snapshot_every_s, last_report,
                             index.recovered_from == "rebuild")
    registered = set() if registered is None else registered  # the keys /register added
    watch = _SourcesFile(args, subscriber, index, registered) if args.sources_file else None
    try:
        while not stop["now"]:
            applied = subscriber.poll(100)
            now = time.monotonic()
            busy_since_trim += applied
            if watch is not None:
                watch.check(now)
            if with_status:
                files(_registry, path, subscriber, index, registered)
            if due := snapshots.due(now, applied, index.stats):
                try:
                    index.snapshot(trim=due != SnapshotRule.BUSY)
                except StoreError as exc:  # the store is away: the next period tries again
                    log.warning("snapshot failed (%s); trying again in %g s", exc,
                                args.snapshot_every_s)
                snapshots.taken(now)
            if with_status and now - last_status >= STATUS_EVERY_S:
                if service is not None:
                    files(_check_workers, service, index)
                files(write_status, path, subscriber, caught_up=subscriber.caught_up,
                      started=started, worker_restarts=service.restarts if service else 0,
                      deal_errors=service.dealer.deal_errors if service else 0,
                      file_errors=files.errors)
                last_status = now
            if now - last_report >= args.report_every_s:
                _report(subscriber)
                last_report = now
            if _trim_due(busy_since_trim, applied, now - last_trim):
                _trim_malloc()
                last_trim, busy_since_trim = now, 0
    finally:
        try:
            subscriber.save_state(durable=True)
        except StoreError as exc:  # re-applying from the last saved state is harmless
            log.warning("could not save the engines' fingerprints at stop (%s)", exc)


class _OwnFiles:
    """serve's own files and processes beside the index (the status file, the
    registry's answers, a replaced worker's socket pair): a call that fails for want of
    descriptors, memory or disk is counted, logged at a limited rate, and made again at
    its next turn; it stops nothing.  Cost: a try per call."""

    def __init__(self) -> None:
        from .applier import RateLimitedLog

        self.errors = 0
        self._log = RateLimitedLog(log)

    def __call__(self, call, *args, **kwargs) -> None:
        try:
            call(*args, **kwargs)
        except OSError as exc:
            self.errors += 1
            self._log.warn("serve", "files", f"sarp: {call.__name__.strip('_')} failed ({exc}); "
                           f"trying again at its next turn")


def _check_workers(service, index) -> None:
    """Replace a worker that died or hangs, and free what it held mid-match."""
    replaced = service.restarts + service.hung
    service.check()
    if service.restarts + service.hung != replaced:
        index.release_dead_readers()


def _more_descriptors() -> None:
    """The open-files limit raised to its hard limit (as Go's runtime does at start):
    each engine followed takes a few sockets (its SUB, its monitor's pair, a replay's
    DEALER), each HTTP connection a descriptor in a worker (forked later, they inherit
    it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _flagged(args) -> list[Source]:
    """The ``--source`` engines, of ``--model-name`` (token-keyed) when one is given."""
    if getattr(args, "shard", None) is not None and "://" not in str(args.index):
        raise ValueError(f"--shard {args.shard} needs a sharded index on Valkey: pass "
                         "--index valkey://HOST:PORT/NAMESPACE")
    sources = [s for spec in args.source for s in Source.expand(spec, args.dp_ranks)]
    keys = [s.key for s in sources]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"--source {', '.join(twice)} named twice; give each engine (or "
                         "rank) one --source with a name of its own")
    if getattr(args, "model_name", None) is None:
        return sources
    if not args.block_size or not 0 < args.block_size <= 0xFFFF:
        raise ValueError(f"--model-name {args.model_name} needs the engines' --block-size "
                         "(tokens per block, 1 to 65535)")
    return [replace(s, model=args.model_name, tenant=args.routing_group,
                    block_size=args.block_size) for s in sources]


def _chosen(args, flags: list[Source], kept: list[tuple[Source, bool]]
            ) -> tuple[list[Source], set[str]]:
    """The engines to follow, and the keys of those registered at runtime: those of
    ``--source`` and of the sources file (the flags win a name) and those registered
    with the last serve; or, with neither flag, every engine the last serve followed."""
    if not flags and not args.sources_file:
        if not kept and args.http:
            log.info("no engines yet: POST /register adds them")
            return [], set()
        if not kept:
            raise ValueError("no engine to follow: name them with --source or --sources-file "
                             "(a restarted serve follows the engines its index's last serve "
                             "followed)")
        log.info("following the engines the last serve followed: %s",
                 ", ".join(s.key for s, _ in kept))
        return [s for s, _ in kept], {s.key for s, reg in kept if reg}
    chosen = {s.key: s for s in flags}
    if args.sources_file:
        for s in read_sources_file(args.sources_file, args.dp_ranks):
            chosen.setdefault(s.key, s)
    registered = set()
    for s, reg in kept:
        if reg and s.key not in chosen:
            chosen[s.key] = s
            registered.add(s.key)
    return list(chosen.values()), registered


class _SourcesFile:
    """``--sources-file``, read again when it changes (checked every second): engines
    it adds are followed (their buffers replayed), engines it drops are cleared, and
    the set is kept with the index.  A file that does not read leaves the set as is."""

    EVERY_S = 1.0

    def __init__(self, args, subscriber: Subscriber, index, registered: set[str]) -> None:
        self.args, self.subscriber, self.index = args, subscriber, index
        self.registered = registered
        # the engines the file put there (not those of --source or of /register)
        flags = {s.key for s in _flagged(args)}
        self.flags = flags | registered
        self.managed = ({s.key for s in self._listed() or []} & set(subscriber.sources)) \
            - self.flags
        self.seen, self.next_at = self._stamp(), 0.0

    def _stamp(self):
        try:
            st = Path(self.args.sources_file).stat()
            return st.st_mtime_ns, st.st_size, st.st_ino
        except OSError:
            return None

    def _listed(self) -> list[Source] | None:
        try:
            return read_sources_file(self.args.sources_file, self.args.dp_ranks)
        except ValueError as exc:
            log.error("sarp: %s; following the engines as before", exc)
            return None

    def check(self, now: float) -> None:
        if now < self.next_at:
            return
        self.next_at = now + self.EVERY_S
        stamp = self._stamp()
        if stamp == self.seen:
            return
        self.seen = stamp
        listed = self._listed()
        if listed is None:
            return
        sub = self.subscriber
        wanted = {s.key: s for s in listed}
        for key in sorted(self.managed):
            if key in sub.sources and wanted.get(key) != sub.sources[key]:
                log.info("sarp: %s left the sources file; clearing it", key)
                sub.remove_source(key)
        self.managed = {k for k in self.managed if k in sub.sources}
        for key, source in wanted.items():
            if key not in sub.sources and key not in self.flags | self.registered:
                log.info("sarp: %s joined the sources file; following it", key)
                try:
                    sub.add_source(source)
                    self.managed.add(key)
                except ValueError as exc:
                    log.error("sarp: %s", exc)
        save_sources(self.index, list(sub.sources.values()), self.registered)


def _registry(status_dir: Path, subscriber: Subscriber, index, registered: set[str]) -> None:
    """Apply the HTTP workers' ``/register`` and ``/unregister`` requests (between two
    polls) and answer each; the engines followed are kept with the index."""
    from .status import answer, take

    changed = False
    for taken, req in take(status_dir):
        name, rank, model = str(req["instance_id"]), req.get("dp_rank"), req.get("model_name")
        tenant = req.get("routing_group", req.get("tenant_id", DEFAULT_TENANT))
        if req["op"] == "register":
            source = Source(name, req["endpoint"], req.get("replay_endpoint"), rank or 0,
                            model, tenant, req.get("block_size") if model else None)
            known = subscriber.sources.get(source.key)
            sizes = {s.block_size for s in subscriber.sources.values()
                     if model and (s.model, s.tenant) == (model, tenant) and s.key != source.key}
            if sizes - {source.block_size}:
                answer(taken, 409, {"error": f"block_size mismatch for model={model} "
                                    f"routing_group={tenant}: its engines have {sizes.pop()}, "
                                    f"this one {source.block_size}", "field": "block_size"})
                continue
            try:
                if known is not None and known != source:
                    subscriber.remove_source(source.key)  # registered again elsewhere
                if known != source:
                    subscriber.add_source(source)
                    changed = True
                registered.add(source.key)
                answer(taken, 201, {"status": "ok", "instance_id": req["instance_id"],
                                    "dp_rank": rank or 0})
            except ValueError as exc:
                answer(taken, 409, {"error": str(exc), "field": "instance_id"})
            except OSError as exc:  # out of descriptors: nothing changed, say so
                answer(taken, 503, {"error": str(exc), "field": "instance_id"})
            continue
        keys = [k for k, s in subscriber.sources.items()
                if s.name == name and (rank is None or (s.dp_rank or 0) == rank)
                and (model is None or s.model == model)]
        for key in keys:
            subscriber.remove_source(key)  # its holders are cleared
            registered.discard(key)
        changed |= bool(keys)
        if keys:
            answer(taken, 200, {"status": "ok", "instance_id": req["instance_id"],
                                "removed": keys})
        else:
            answer(taken, 404, {"error": f"instance {name} (dp rank {rank}) is not "
                                         "registered; GET /workers lists those that are",
                                "field": "instance_id"})
    if changed:
        save_sources(index, list(subscriber.sources.values()), registered)


def _trim_due(batches_since: int, applied: int, since_s: float) -> bool:
    """Whether serve's loop hands freed memory back now: at the first idle poll after
    work, at most every ``TRIM_EVERY_S``, but at once after a backlog
    (``TRIM_AFTER_BATCHES``: its messages' memory, freed, is most of serve's then).

    >>> _trim_due(5, 0, 2.0), _trim_due(5, 0, 0.3), _trim_due(5_000, 0, 0.3), _trim_due(5, 3, 9)
    (True, False, True, False)
    """
    return bool(batches_since) and not applied and (
        since_s >= TRIM_EVERY_S or batches_since >= TRIM_AFTER_BATCHES)


def _trim_malloc() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``): a backlog's
    messages pass through libzmq's I/O thread, whose malloc arena kept 45 MB after a
    Mooncake drain, freed but resident.  And the table the aliases' resolution keeps
    between batches (:func:`sarp.aliases.release`, a few MB).  Cost: a walk of the free
    lists, about a millisecond; nothing where the C library has no such call."""
    global _libc
    from .. import aliases  # (imported by the index already)

    aliases.release()
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def _report(subscriber: Subscriber) -> None:
    for name, s in subscriber.summary().items():
        log.info("%s: seq %s, %d batches, %d gaps, %d replayed, %d restarts, "
                 "%d times gone, %d bad batches, %d bad frames, bad events %s", name,
                 s["last_seq"], s["batches"], s["gaps"], s["replayed"],
                 s["restarts"], s["gone"], s["bad_payloads"], s["bad_frames"],
                 dict(s["applied"]["bad_events"]) or "none")


def _start_http(args, dealer, zygote, status_dir: str, index):
    from .workers import HttpConfig, HttpService

    host, port = dealer.listener.getsockname()[:2]
    config = HttpConfig(str(args.index), zygote.metrics_dir, scheme=args.hash_scheme,
                        seed=args.hash_seed, block_size=args.block_size, status_dir=status_dir,
                        token=args.http_token, request_timeout_s=args.http_request_timeout_s,
                        idle_timeout_s=args.http_idle_timeout_s,
                        sharded=getattr(args, "shard", None) is not None)
    service = HttpService(dealer, config, zygote, index)
    log.info("HTTP on %s:%d %s", host, port, "on a thread of serve's own" if zygote.in_process
             else f"with {len(service.procs)} worker processes")
    return service
