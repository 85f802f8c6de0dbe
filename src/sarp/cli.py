"""The ``sarp`` command: ``sarp bench``, ``sarp bench-events``, ``sarp serve``, ``sarp workingset``,
``sarp verify PATH``, ``sarp repair PATH --out NEW``, ``sarp stats PATH``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import argcheck as ac
from .errors import TraceError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    early = None
    if argv[:1] == ["serve"]:  # its first answers and engines, before numpy is imported
        from .serving.early import start

        early = start(argv[1:])
    try:
        return _main(argv, early)
    finally:
        if early is not None:  # (serve's dealer stops the child once the workers run)
            early.close()


def _main(argv: list[str], early) -> int:
    from . import __version__, native
    from .argcheck import Parser

    parser = Parser(prog="sarp", description=__doc__)
    parser.add_argument("--version", action="version",
                        version=f"sarp {__version__} (hot loops in "
                        f"{'C' if native.C is not None else 'Python'})")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (_bench_parser, _workingset_parser, _serve_parser, _cluster_parser,
                _bench_events_parser, _repair_parser, _verify_and_stats_parser):
        add(sub)  # one function per command's options, one per command's run (COMMANDS)
    args = parser.parse_args(argv)
    if args.command == "serve":
        args.early = early
    if getattr(args, "plot", None) is not None:  # before the run, not after it
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            return ac.refuse(f"sarp {args.command}", f"--plot {args.plot} needs matplotlib, "
                             "which is not installed: pip install 'sarp[bench]'")
    try:
        return COMMANDS[args.command](args)
    except TraceError as exc:  # the file named by --trace is not a trace
        return ac.refuse(f"sarp {args.command}", str(exc))
    except BrokenPipeError:  # `sarp stats ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _trace_options(p, *, required: bool = False) -> None:
    """--trace, --split and --limit-requests, as every trace-reading command has them."""
    p.add_argument("--trace", required=required, type=ac.trace,
                   help="mooncake-format .jsonl or .jsonl.gz"
                   + ("" if required else " (default: the built-in workload)"))
    p.add_argument("--split", type=ac.count, default=1,
                   help="sub-blocks per block of the trace (4 turns 64-token blocks into 16)")
    p.add_argument("--limit-requests", type=ac.count, default=None,
                   help="read at most this many requests (default: all)")


def _bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="replay a trace through sarp and the baselines")
    _trace_options(bench)
    bench.add_argument("--indexes", default=None,
                       help="comma-separated index names (default: sarp and the four "
                       "baselines; a name it does not know is refused with the list)")
    bench.add_argument("--workdir", type=ac.index_location, default=None,
                       help="where the indexes' files go (default: a temporary folder)")
    bench.add_argument("--json", type=Path, default=None, help="write the results here")
    bench.add_argument("--plot", type=Path, default=None,
                       help="draw the results here (.png; needs the bench extra)")
    bench.add_argument("--segment-blocks", type=ac.count, default=None,
                       help="sarp's blocks per segment (default: sarp's own)")
    bench.add_argument("--passes", type=ac.count, default=5,
                       help="warm, batch and cold passes per index, interleaved")
    bench.add_argument("--pass-s", type=ac.seconds, default=1.0,
                       help="least seconds per warm or batch pass")
    bench.add_argument("--mix-ids", action="store_true",
                       help="spread the trace's sequential ids like engine hashes")
    bench.add_argument("--durability", default="nosync", choices=["sync", "nosync"],
                       help="for every index alike (nosync survives a process crash)")


def _workingset_parser(sub) -> None:
    ws = sub.add_parser("workingset", help="hit rate at every LRU cache capacity, one pass")
    _trace_options(ws, required=True)
    ws.add_argument("--target", type=ac.positive, action="append", default=[],
                    help="hit rate as a fraction of the unbounded one (repeatable, e.g. 0.9)")
    ws.add_argument("--target-abs", type=ac.positive, action="append", default=[],
                    help="absolute hit rate (repeatable, e.g. 0.5)")
    ws.add_argument("--block-tokens", type=ac.count, default=None,
                    help="tokens per block, for capacities in tokens (per block of the trace "
                         "after --split)")
    ws.add_argument("--bytes-per-block", type=ac.count, default=None,
                    help="KV bytes per block, for capacities in bytes")
    ws.add_argument("--sample-rate", type=ac.positive, default=None,
                    help="track only this fraction of blocks (SHARDS); default: exact")
    ws.add_argument("--sample-size", type=ac.count, default=None,
                    help="track at most this many blocks (SHARDS, fixed size)")
    ws.add_argument("--json", type=Path, default=None, help="write the results here")
    ws.add_argument("--plot", type=Path, default=None,
                    help="draw the curve here (.png; needs the bench extra)")


def _serve_parser(sub) -> None:
    from .hashing import VLLM_DEFAULT_SCHEME

    def source(text: str) -> str:
        from .serving.sources import Source  # when a --source is given, not for every command

        try:
            Source.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    def host_port(text: str) -> str:
        from .serving.access import parse_address

        try:
            parse_address(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("--http ")) from None
        return text

    serve = sub.add_parser("serve", help="follow engines' KV events into an index")
    serve.add_argument("--index", required=True, type=ac.index_location,
                       help="index directory, or valkey://HOST:PORT/NAMESPACE")
    serve.add_argument("--source", action="append", default=[], type=source,
                       help="NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT], repeatable; with --dp-ranks "
                       "the endpoints of rank 0")
    serve.add_argument("--sources-file", default=None, type=ac.readable_file,
                       help="a YAML or JSON list of engines (a ConfigMap mounted as a file), "
                       "read again when it changes: engines added are followed, engines "
                       "gone are cleared. Without --source or --sources-file, serve follows "
                       "the engines the index's last serve followed")
    serve.add_argument("--dp-ranks", type=ac.count, default=None,
                       help="each source is an engine with this many DP ranks, rank r on the "
                       "ports of rank 0 + r (as vLLM and SGLang bind them); holders NAME#r")
    serve.add_argument("--replay-idle-timeout-s", type=ac.seconds, default=5.0,
                       help="a replay that delivers nothing for this long is over")
    serve.add_argument("--replay-budget-s", type=ac.seconds, default=60.0,
                       help="one replay attempt may take this long; one over it clears the "
                       "engine's holders and is retried with backoff")
    serve.add_argument("--max-engines", type=ac.count, default=4096,
                       help="engines (ranks) followed at most, from every source; one "
                       "more is refused (each takes a few sockets and a replay)")
    serve.add_argument("--max-frame-bytes", type=ac.count_from(1024), default=64 << 20,
                       help="frames from engines larger than this are dropped before they "
                       "are received (the connection is dropped and made again)")
    serve.add_argument("--probe-after-s", type=ac.seconds_or_zero, default=30.0,
                       help="ask an engine that has sent nothing for this long whether it is "
                       "there (on its replay endpoint); 0: never")
    serve.add_argument("--dead-after-s", type=ac.seconds, default=10.0,
                       help="an engine that does not answer within this long is taken as "
                       "gone: its holders are cleared")
    serve.add_argument("--commit-wait-ms", type=ac.milliseconds_up_to(20.0),
                       default=5.0,
                       help="how long the first batch of a commit waits for more once the "
                       "engines' sockets ran dry (0: commit at once: fresher answers, far "
                       "more CPU at a steady rate)")
    serve.add_argument("--http", default=None, metavar="HOST:PORT", type=host_port,
                       help="also answer HTTP: POST /v1/match and /query, /register, GET "
                       "/metrics, /healthz, /readyz, /openapi.json (default: no HTTP)")
    serve.add_argument("--http-token-file", default=None, metavar="FILE",
                       type=ac.readable_file,
                       help="a file holding a bearer token that every endpoint but /healthz "
                       "and /readyz asks for; needed to bind beyond loopback")
    serve.add_argument("--http-allow-unauthenticated", action="store_true",
                       help="bind beyond loopback without a token (behind a proxy that "
                       "authenticates and terminates TLS)")
    serve.add_argument("--http-request-timeout-s", type=ac.seconds, default=10.0,
                       help="a request's headers and body must arrive within this (else the "
                       "connection is closed)")
    serve.add_argument("--http-idle-timeout-s", type=ac.seconds, default=30.0,
                       help="a keep-alive connection with nothing asked is closed after this")
    serve.add_argument("--http-workers", type=ac.count_from(0), default=None,
                       help="HTTP worker processes, each with a readonly open of the index; "
                       "0: HTTP on a thread of serve's own, from the writer's index (one "
                       "process, the least memory; a folder index only) (default: the "
                       "usable cores less one, the writer's, from 1 to 8)")
    serve.add_argument("--hash-scheme", default=VLLM_DEFAULT_SCHEME,
                       choices=["vllm-sha256", "vllm-sha256-cbor", "vllm-xxhash",
                                "vllm-xxhash-cbor", "sglang", "xxh3"],
                       help="how /v1/match hashes token_ids: the engines' scheme (vllm-sha256 "
                       "is vLLM's --prefix-caching-hash-algo sha256, vllm-sha256-cbor its "
                       "sha256_cbor, and so on; docs/operating.md)")
    serve.add_argument("--hash-seed", default=None,
                       help="the engines' PYTHONHASHSEED, for the vLLM schemes (default: "
                       "$PYTHONHASHSEED, else vLLM's own)")
    serve.add_argument("--block-size", type=ac.block_size, default=None,
                       help="the engines' block size, for token_ids requests without one "
                       "(and the model's, with --model-name)")
    serve.add_argument("--model-name", default=None,
                       help="the model of the --source engines: their blocks are keyed by "
                       "their tokens, for POST /query (needs --block-size)")
    serve.add_argument("--routing-group", default="default",
                       help="the routing group (tenant) of the --source engines' model")
    serve.add_argument("--durability", default="sync", choices=["sync", "nosync"],
                       help="sync: every commit on disk before it returns; nosync: survives "
                       "a crash of serve, not of the machine")
    serve.add_argument("--snapshot-every-s", type=ac.seconds, default=60.0,
                       help="write the directory snapshot this often (and when idle after "
                       "a burst), so a restart replays a short log")
    serve.add_argument("--report-every-s", type=ac.seconds, default=30.0,
                       help="log a line of counters this often")
    serve.add_argument("--lease-s", type=ac.seconds, default=10.0,
                       help="on Valkey: the writer lease, renewed while serve runs")
    serve.add_argument("--wait-for-lease-s", type=ac.seconds_or_zero, default=0.0,
                       help="on Valkey: wait this long for the lease (a standby that takes "
                       "over when the writer stops renewing)")
    serve.add_argument("--shard", default=None, type=ac.shard,
                       help="on Valkey: write this shard of the sharded index at --index "
                       "(the engines named here); the HTTP workers answer from every shard")


def _cluster_parser(sub) -> None:
    cl = sub.add_parser("cluster", help="simulate engines + events + routing on a trace")
    _trace_options(cl)
    cl.add_argument("--engines", type=ac.count, default=4, help="simulated engines")
    cl.add_argument("--capacity-blocks", type=ac.count, default=10_000,
                    help="LRU cache per engine")
    cl.add_argument("--drop-rate", type=ac.fraction, default=0.01,
                    help="fraction of event batches dropped on the live stream")
    cl.add_argument("--policies", default="random,round-robin,sarp",
                    help="routing policies compared, comma-separated")
    cl.add_argument("--json", type=Path, default=None, help="write the results here")


def _bench_events_parser(sub) -> None:
    be = sub.add_parser("bench-events", help="event ingestion: backlog drain, offered-rate "
                        "sweep, baselines")
    _trace_options(be)
    be.add_argument("--engines", type=ac.count, default=8, help="simulated engines")
    be.add_argument("--capacity-blocks", type=ac.count, default=10_000,
                    help="LRU cache per engine")
    be.add_argument("--rates", type=ac.rates,
                    default=[2000, 5000, 10000, 15000, 20000, 25000, 30000, 40000, 50000],
                    help="offered events/s, comma-separated")
    be.add_argument("--rate-s", type=ac.seconds, default=3.0, help="seconds offered per rate")
    be.add_argument("--repeat", type=ac.count, default=5,
                    help="backlog and direct runs (medians)")
    be.add_argument("--chunk-events", type=ac.count, default=None,
                    help="events per transaction in the direct apply (default: what sarp "
                    "serve commits at most in one while it catches up, 16,384)")
    be.add_argument("--index", type=ac.valkey_url, default=None,
                    help="valkey://HOST:PORT/PREFIX: measure only the drain and the direct "
                    "apply on namespaces of that server against LMDB (interleaved)")
    be.add_argument("--workdir", type=ac.index_location, default=None,
                    help="where the indexes' files go (default: a temporary folder)")
    be.add_argument("--json", type=Path, default=None, help="write the results here")
    be.add_argument("--plot", type=Path, default=None,
                    help="draw the sweep here (.png; needs the bench extra)")


def _repair_parser(sub) -> None:
    rp = sub.add_parser("repair", help="write a new index from every readable record")
    rp.add_argument("path", type=ac.existing_index, help="the damaged index folder")
    rp.add_argument("--out", type=ac.new_folder, required=True,
                    help="the new index (a new folder)")


def _verify_and_stats_parser(sub) -> None:
    for name, text in (("verify", "check every invariant of an index"),
                       ("stats", "print an index's sizes and counters (and, beside a "
                        "running serve, serve's own)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("path", type=ac.existing_index,
                       help="index directory, or valkey://HOST:PORT/NAMESPACE")


def _bench_events(args: argparse.Namespace) -> int:
    from .bench.ingest import run

    return run(args)


def _serve(args: argparse.Namespace) -> int:
    from .errors import IndexLockedError, SarpError

    zygote = None
    if args.http:  # (--http-workers is a count: 0, HTTP in process, or more)
        # The HTTP workers' zygote, forked before serve's own imports (ZeroMQ, the
        # decoder, the dealer): it imports the HTTP stack meanwhile, and a restart's
        # workers answer sooner (docs/performance.md).  run() stops it, whatever fails.
        # The core first: the zygote and its workers share its pages with serve.
        from . import index, store_lmdb  # noqa: F401
        from .serving.workers import default_workers, start_zygote

        if args.http_workers is None:
            args.http_workers = default_workers()
        # (it closes what it inherits: the first answers' sockets, the engines')
        zygote = start_zygote(args.http_workers)
    from .serving.serve import run

    try:
        return run(args, zygote)
    except IndexLockedError as exc:  # another writer: said in the command's own words
        text = str(exc).replace("open readonly=True to read beside it, or pass "
                                "wait_for_lease_s", "run a standby with --wait-for-lease-s")
        print(f"sarp serve: {text}", file=sys.stderr)
        return 1
    except SarpError as exc:  # the store failed (disk full, damage): say so, stop
        print(f"sarp serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"sarp serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the system refuses, wherever it was met
        print(f"sarp serve: {exc.filename or ''}: {exc.strerror or exc}; check the path "
              "and that this user may use it", file=sys.stderr)
        return 2


def _workingset(args: argparse.Namespace) -> int:
    from .workingset.cli import run

    return run(args)


def _verify_command(args: argparse.Namespace) -> int:
    return _verify(args.path)


def _repair(args: argparse.Namespace) -> int:
    import sarp

    from .repair import repair

    try:
        report = repair(args.path, args.out)
    except (ValueError, sarp.SarpError) as exc:
        print(f"sarp repair: {exc}", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    print(f"wrote {args.out}; check it with: sarp verify {args.out}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    import sarp

    from .serving.status import running_serve

    try:
        # Readonly: works beside a running writer (sarp serve) and changes nothing.
        with sarp.open(args.path, readonly=True) as index:
            out = index.stats()
    except sarp.SarpError as exc:
        print(f"sarp stats: {exc}", file=sys.stderr)
        return 1
    serve = running_serve(args.path)
    if serve is not None:  # its counters, not this process's zeros
        out["serve"] = serve
    print(json.dumps(out, indent=2))
    return 0


def _verify_child(path: str, conn) -> None:
    import sarp

    try:
        with sarp.open(path, readonly=True) as index:
            conn.send(("problems", index.check()))
    except Exception as exc:  # noqa: BLE001 - whatever the damage, it is a line of the report
        conn.send(("refused", f"{type(exc).__name__}: {exc}"))


def _verify(path: str) -> int:
    """Check every invariant in a child process, so that damage LMDB cannot survive
    (an assertion, a SIGBUS) becomes a line of the report instead of a dead command."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_verify_child, args=(str(path), there))
    child.start()
    there.close()
    try:
        kind, detail = here.recv()
    except EOFError:
        kind, detail = "crashed", None
    child.join()
    if kind == "crashed":
        code = child.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        data = Path(path) / "data.mdb"
        problems = [f"{data}: walking the LMDB pages crashed the checker ({how}); "
                    f"the file is damaged. Salvage what can be read with: sarp repair {path} "
                    "--out NEW_FOLDER"]
    elif kind == "refused":
        problems = [detail]
    else:
        problems = detail
    for line in problems:
        print(line)
    print(f"{len(problems)} problem(s) in {path}")
    return 1 if problems else 0


def _cluster(args: argparse.Namespace) -> int:
    from .bench import load_requests
    from .bench.cluster import POLICIES, simulate

    policies = args.policies.split(",")
    if any(p not in POLICIES for p in policies):
        return ac.refuse("sarp cluster", f"--policies {args.policies}: pick from "
                         f"{','.join(POLICIES)}")
    label, requests = load_requests(args.trace, args.split, args.limit_requests)
    print(f"{label}: {len(requests)} requests, {args.engines} engines x "
          f"{args.capacity_blocks} blocks, {args.drop_rate:.0%} of event batches dropped")
    print(f"{'policy':<12}{'hit rate':>10}{'gaps':>8}{'events/s':>11}{'blocks/s':>11}"
          f"{'index = caches':>16}", flush=True)
    rows = []
    for policy in policies:  # a row as each policy's run ends (each has its own cluster)
        r = simulate([q.hashes for q in requests], policies=[policy], engines=args.engines,
                     capacity_blocks=args.capacity_blocks, drop_rate=args.drop_rate)[0]
        rows.append(r)
        print(f"{r['policy']:<12}{r['hit_rate']:>10.4f}{r['gaps']:>8}{r['events_per_s']:>11.0f}"
              f"{r['blocks_per_s']:>11.0f}{str(r['index_equals_caches']):>16}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"trace": label, "engines": args.engines,
                                         "capacity_blocks": args.capacity_blocks,
                                         "drop_rate": args.drop_rate, "policies": rows},
                                        indent=2))
    return 0 if all(r["index_equals_caches"] for r in rows) else 1


def _bench(args: argparse.Namespace) -> int:
    from . import bench
    from .bench.baselines import NAMES, needs

    indexes = args.indexes.split(",") if args.indexes else list(bench.DEFAULT_INDEXES)
    unknown = [n for n in indexes if n not in NAMES]
    if unknown:
        return ac.refuse("sarp bench", f"--indexes {args.indexes}: {', '.join(unknown)} "
                         f"unknown; pick from {', '.join(NAMES)}")
    missing = needs(indexes)
    if missing:
        return ac.refuse("sarp bench", missing)
    options: dict = {"durability": args.durability}
    if args.segment_blocks:
        options["segment_blocks"] = args.segment_blocks
    label, requests = bench.load_requests(args.trace, args.split, args.limit_requests,
                                          args.mix_ids)
    result = bench.run(requests, label=label, indexes=indexes, workdir=args.workdir,
                       options=options, progress=True, passes=args.passes,
                       pass_s=args.pass_s)
    print(bench.table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        bench.plot(result, args.plot)
    return 0


COMMANDS = {"bench": _bench, "cluster": _cluster, "bench-events": _bench_events,
            "serve": _serve, "workingset": _workingset, "verify": _verify_command,
            "repair": _repair, "stats": _stats}

if __name__ == "__main__":
    sys.exit(main())
