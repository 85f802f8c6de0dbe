"""The ``sarp`` command: ``sarp bench``, ``sarp verify PATH``, ``sarp stats PATH``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sarp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="replay a trace through sarp and the baselines")
    bench.add_argument("--trace", help="mooncake-format .jsonl or .jsonl.gz (default: built-in)")
    bench.add_argument("--split", type=int, default=1, help="sub-blocks per block (4: 64->16)")
    bench.add_argument("--limit-requests", type=int, default=None)
    bench.add_argument("--indexes", default=None, help="comma-separated (default: all)")
    bench.add_argument("--workdir", type=Path, default=None)
    bench.add_argument("--json", type=Path, default=None)
    bench.add_argument("--plot", type=Path, default=None)
    bench.add_argument("--segment-blocks", type=int, default=None)
    bench.add_argument("--durability", default="nosync", choices=["sync", "nosync"],
                       help="for every index alike (default nosync: survives a process crash)")

    for name, text in (("verify", "check every invariant of an index"),
                       ("stats", "print an index's sizes and counters")):
        p = sub.add_parser(name, help=text)
        p.add_argument("path", type=Path)

    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    import sarp

    if not args.path.exists():
        print(f"sarp: {args.path} does not exist", file=sys.stderr)
        return 2
    with sarp.open(args.path, create=False) as index:
        if args.command == "stats":
            print(json.dumps(index.stats(), indent=2))
            return 0
        problems = index.check()
    for line in problems:
        print(line)
    print(f"{len(problems)} problem(s) in {args.path}")
    return 1 if problems else 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench
    from .baselines import NAMES

    indexes = args.indexes.split(",") if args.indexes else list(bench.DEFAULT_INDEXES)
    unknown = [n for n in indexes if n not in NAMES]
    if unknown:
        print(f"sarp bench: unknown index {unknown}; pick from {', '.join(NAMES)}",
              file=sys.stderr)
        return 2
    options: dict = {"durability": args.durability}
    if args.segment_blocks:
        options["segment_blocks"] = args.segment_blocks
    label, requests = bench.load_requests(args.trace, args.split, args.limit_requests)
    result = bench.run(requests, label=label, indexes=indexes, workdir=args.workdir,
                       options=options, progress=sys.stderr.isatty())
    print(bench.table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        bench.plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
