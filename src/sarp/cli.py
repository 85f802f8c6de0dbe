"""The ``sarp`` command: ``sarp bench``, ``sarp bench-events``, ``sarp serve``, ``sarp workingset``,
``sarp verify PATH``, ``sarp repair PATH --out NEW``, ``sarp stats PATH``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sarp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_bench_parser, _workingset_parser, _serve_parser, _cluster_parser,
                _bench_events_parser, _repair_parser, _verify_and_stats_parser):
        add(sub)  # one function per command's options, one per command's run (COMMANDS)
    args = parser.parse_args(argv)
    return COMMANDS[args.command](args)


def _bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="replay a trace through sarp and the baselines")
    bench.add_argument("--trace", help="mooncake-format .jsonl or .jsonl.gz (default: built-in)")
    bench.add_argument("--split", type=int, default=1, help="sub-blocks per block (4: 64->16)")
    bench.add_argument("--limit-requests", type=int, default=None)
    bench.add_argument("--indexes", default=None, help="comma-separated (default: all)")
    bench.add_argument("--workdir", type=Path, default=None)
    bench.add_argument("--json", type=Path, default=None)
    bench.add_argument("--plot", type=Path, default=None)
    bench.add_argument("--segment-blocks", type=int, default=None)
    bench.add_argument("--passes", type=int, default=5,
                       help="warm, batch and cold passes per index, interleaved (default 5)")
    bench.add_argument("--pass-s", type=float, default=1.0,
                       help="least seconds per warm or batch pass (default 1.0)")
    bench.add_argument("--mix-ids", action="store_true",
                       help="spread the trace's sequential ids like engine hashes")
    bench.add_argument("--durability", default="nosync", choices=["sync", "nosync"],
                       help="for every index alike (default nosync: survives a process crash)")


def _workingset_parser(sub) -> None:
    ws = sub.add_parser("workingset", help="hit rate at every LRU cache capacity, one pass")
    ws.add_argument("--trace", required=True, help="mooncake-format .jsonl or .jsonl.gz")
    ws.add_argument("--split", type=int, default=1, help="sub-blocks per block")
    ws.add_argument("--limit-requests", type=int, default=None)
    ws.add_argument("--target", type=float, action="append", default=[],
                    help="hit rate as a fraction of the unbounded one (repeatable, e.g. 0.9)")
    ws.add_argument("--target-abs", type=float, action="append", default=[],
                    help="absolute hit rate (repeatable, e.g. 0.5)")
    ws.add_argument("--block-tokens", type=int, default=None,
                    help="tokens per block, for capacities in tokens (per block of the trace "
                         "after --split)")
    ws.add_argument("--bytes-per-block", type=int, default=None,
                    help="KV bytes per block, for capacities in bytes")
    ws.add_argument("--sample-rate", type=float, default=None,
                    help="track only this fraction of blocks (SHARDS); default: exact")
    ws.add_argument("--sample-size", type=int, default=None,
                    help="track at most this many blocks (SHARDS, fixed size)")
    ws.add_argument("--json", type=Path, default=None)
    ws.add_argument("--plot", type=Path, default=None)


def _serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="follow engines' KV events into an index")
    serve.add_argument("--index", required=True,
                       help="index directory, or valkey://HOST:PORT/NAMESPACE")
    serve.add_argument("--source", action="append", default=[],
                       help="NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT], repeatable; with --dp-ranks "
                       "the endpoints of rank 0")
    serve.add_argument("--sources-file", default=None,
                       help="a YAML or JSON list of engines (a ConfigMap mounted as a file), "
                       "read again when it changes: engines added are followed, engines "
                       "gone are cleared. Without --source or --sources-file, serve follows "
                       "the engines the index's last serve followed")
    serve.add_argument("--dp-ranks", type=int, default=None,
                       help="each source is an engine with this many DP ranks, rank r on the "
                       "ports of rank 0 + r (as vLLM and SGLang bind them); holders NAME#r")
    serve.add_argument("--replay-idle-timeout-s", type=float, default=5.0,
                       help="a replay that delivers nothing for this long is over")
    serve.add_argument("--replay-budget-s", type=float, default=60.0,
                       help="one replay attempt may take this long; one over it clears the "
                       "engine's holders and is retried with backoff")
    serve.add_argument("--max-frame-bytes", type=int, default=64 << 20,
                       help="frames from engines larger than this are dropped before they "
                       "are received (the connection is dropped and made again)")
    serve.add_argument("--probe-after-s", type=float, default=30.0,
                       help="ask an engine that has sent nothing for this long whether it is "
                       "there (on its replay endpoint); 0: never")
    serve.add_argument("--dead-after-s", type=float, default=10.0,
                       help="an engine that does not answer within this long is taken as "
                       "gone: its holders are cleared")
    serve.add_argument("--http", default=None, metavar="HOST:PORT",
                       help="also answer POST /v1/match, GET /metrics, /healthz, /readyz")
    serve.add_argument("--http-token-file", default=None, metavar="FILE",
                       help="a file holding a bearer token that every endpoint but /healthz "
                       "and /readyz asks for; needed to bind beyond loopback")
    serve.add_argument("--http-allow-unauthenticated", action="store_true",
                       help="bind beyond loopback without a token (behind a proxy that "
                       "authenticates and terminates TLS)")
    serve.add_argument("--http-request-timeout-s", type=float, default=10.0,
                       help="a request's headers and body must arrive within this (else the "
                       "connection is closed)")
    serve.add_argument("--http-idle-timeout-s", type=float, default=30.0,
                       help="a keep-alive connection with nothing asked is closed after this")
    serve.add_argument("--http-workers", type=int, default=2,
                       help="HTTP worker processes, each with a readonly open of the index")
    from .hashing import VLLM_DEFAULT_SCHEME

    serve.add_argument("--hash-scheme", default=VLLM_DEFAULT_SCHEME,
                       choices=["vllm-sha256", "vllm-sha256-cbor", "vllm-xxhash",
                                "vllm-xxhash-cbor", "sglang", "xxh3"],
                       help="how /v1/match hashes token_ids: the engines' scheme (default "
                       "vllm-sha256, vLLM's --prefix-caching-hash-algo default sha256; "
                       "vllm-sha256-cbor for sha256_cbor, and so on)")
    serve.add_argument("--hash-seed", default=None,
                       help="the engines' PYTHONHASHSEED, for the vLLM schemes")
    serve.add_argument("--block-size", type=int, default=None,
                       help="the engines' block size, for token_ids requests without one "
                       "(and the model's, with --model-name)")
    serve.add_argument("--model-name", default=None,
                       help="the model of the --source engines: their blocks are keyed by "
                       "their tokens, for POST /query (needs --block-size)")
    serve.add_argument("--routing-group", default="default",
                       help="the routing group (tenant) of the --source engines' model")
    serve.add_argument("--durability", default="sync", choices=["sync", "nosync"])
    serve.add_argument("--snapshot-every-s", type=float, default=60.0)
    serve.add_argument("--report-every-s", type=float, default=30.0)
    serve.add_argument("--lease-s", type=float, default=10.0,
                       help="on Valkey: the writer lease, renewed while serve runs")
    serve.add_argument("--wait-for-lease-s", type=float, default=0.0,
                       help="on Valkey: wait this long for the lease (a standby that takes "
                       "over when the writer stops renewing)")


def _cluster_parser(sub) -> None:
    cl = sub.add_parser("cluster", help="simulate engines + events + routing on a trace")
    cl.add_argument("--trace", help="mooncake-format trace (default: built-in workload)")
    cl.add_argument("--split", type=int, default=1)
    cl.add_argument("--limit-requests", type=int, default=None)
    cl.add_argument("--engines", type=int, default=4)
    cl.add_argument("--capacity-blocks", type=int, default=10_000, help="LRU cache per engine")
    cl.add_argument("--drop-rate", type=float, default=0.01,
                    help="fraction of event batches dropped on the live stream")
    cl.add_argument("--policies", default="random,round-robin,sarp")
    cl.add_argument("--json", type=Path, default=None)


def _bench_events_parser(sub) -> None:
    be = sub.add_parser("bench-events", help="event ingestion: backlog drain, offered-rate "
                        "sweep, baselines")
    be.add_argument("--trace", help="mooncake-format trace (default: built-in workload)")
    be.add_argument("--split", type=int, default=1)
    be.add_argument("--limit-requests", type=int, default=None)
    be.add_argument("--engines", type=int, default=8)
    be.add_argument("--capacity-blocks", type=int, default=10_000, help="LRU cache per engine")
    be.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")],
                    default=[2000, 5000, 10000, 15000, 20000, 25000, 30000, 40000, 50000],
                    help="offered events/s, comma-separated")
    be.add_argument("--rate-s", type=float, default=3.0, help="seconds offered per rate")
    be.add_argument("--repeat", type=int, default=5, help="backlog and direct runs (medians)")
    be.add_argument("--chunk-events", type=int, default=None,
                    help="events per transaction in the direct apply (default: what sarp "
                    "serve commits at most in one while it catches up, 16,384)")
    be.add_argument("--workdir", default=None)
    be.add_argument("--json", type=Path, default=None)
    be.add_argument("--plot", type=Path, default=None)


def _repair_parser(sub) -> None:
    rp = sub.add_parser("repair", help="write a new index from every readable record")
    rp.add_argument("path", type=Path)
    rp.add_argument("--out", type=Path, required=True, help="the new index (a new folder)")


def _verify_and_stats_parser(sub) -> None:
    for name, text in (("verify", "check every invariant of an index"),
                       ("stats", "print an index's sizes and counters")):
        p = sub.add_parser(name, help=text)
        p.add_argument("path", help="index directory, or valkey://HOST:PORT/NAMESPACE")


def _bench_events(args: argparse.Namespace) -> int:
    from .bench.ingest import run

    return run(args)


def _serve(args: argparse.Namespace) -> int:
    from .errors import SarpError
    from .serving.serve import run

    try:
        return run(args)
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


def _exists(path) -> bool:
    if "://" not in str(path) and not Path(path).exists():
        print(f"sarp: {path} does not exist", file=sys.stderr)
        return False
    return True


def _verify_command(args: argparse.Namespace) -> int:
    return _verify(args.path) if _exists(args.path) else 2


def _repair(args: argparse.Namespace) -> int:
    import sarp

    from .repair import repair

    if not _exists(args.path):
        return 2
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

    if not _exists(args.path):
        return 2
    try:
        # Readonly: works beside a running writer (sarp serve) and changes nothing.
        with sarp.open(args.path, readonly=True) as index:
            print(json.dumps(index.stats(), indent=2))
            return 0
    except sarp.SarpError as exc:
        print(f"sarp stats: {exc}", file=sys.stderr)
        return 1


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
    if any(p not in POLICIES for p in policies) or not 0 <= args.drop_rate < 1:
        print(f"sarp cluster: policies from {POLICIES}, drop rate in [0, 1)", file=sys.stderr)
        return 2
    label, requests = load_requests(args.trace, args.split, args.limit_requests)
    rows = simulate([r.hashes for r in requests], policies=policies, engines=args.engines,
                    capacity_blocks=args.capacity_blocks, drop_rate=args.drop_rate)
    print(f"{label}: {len(requests)} requests, {args.engines} engines x "
          f"{args.capacity_blocks} blocks, {args.drop_rate:.0%} of event batches dropped")
    print(f"{'policy':<12}{'hit rate':>10}{'gaps':>8}{'events/s':>11}{'blocks/s':>11}"
          f"{'index = caches':>16}")
    for r in rows:
        print(f"{r['policy']:<12}{r['hit_rate']:>10.4f}{r['gaps']:>8}{r['events_per_s']:>11.0f}"
              f"{r['blocks_per_s']:>11.0f}{str(r['index_equals_caches']):>16}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"trace": label, "engines": args.engines,
                                         "capacity_blocks": args.capacity_blocks,
                                         "drop_rate": args.drop_rate, "policies": rows},
                                        indent=2))
    return 0 if all(r["index_equals_caches"] for r in rows) else 1


def _bench(args: argparse.Namespace) -> int:
    from . import bench
    from .bench.baselines import NAMES

    indexes = args.indexes.split(",") if args.indexes else list(bench.DEFAULT_INDEXES)
    unknown = [n for n in indexes if n not in NAMES]
    if unknown:
        print(f"sarp bench: unknown index {unknown}; pick from {', '.join(NAMES)}",
              file=sys.stderr)
        return 2
    options: dict = {"durability": args.durability}
    if args.segment_blocks:
        options["segment_blocks"] = args.segment_blocks
    label, requests = bench.load_requests(args.trace, args.split, args.limit_requests,
                                          args.mix_ids)
    if args.passes < 1 or not args.pass_s > 0:
        print(f"sarp bench: --passes {args.passes} --pass-s {args.pass_s}; pass at least 1 "
              "pass of more than 0 s (5 passes of 1 s give stable medians)", file=sys.stderr)
        return 2
    result = bench.run(requests, label=label, indexes=indexes, workdir=args.workdir,
                       options=options, progress=sys.stderr.isatty(), passes=args.passes,
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
