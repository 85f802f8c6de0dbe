"""``sarp bench`` for two source trees, interleaved: did a change move sarp's figures or
its ratios against the baselines?

Each pass is a fresh process running ``sarp bench`` from one tree (``PYTHONPATH``); the
trees take turns (A, B, A, B, ...).  Printed per metric: each tree's median and range
of sarp's figure and of its ratio to each baseline measured in the same run, and B/A::

    git worktree add /tmp/old 98790bd && cd /tmp/old/src/sarp
    INC=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    cc -shared -fPIC -O2 -I"$INC" _native.c native_pack.c native_events.c \\
        -o _native.cpython-311-x86_64-linux-gnu.so && cd -
    .venv/bin/python benchmarks/bench_ab.py --a /tmp/old/src --b src --repeat 5 \\
        --json bench-results/ab-builtin.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

METRICS = ("match_requests_per_s", "batch_match_requests_per_s", "cold_match_requests_per_s",
           "insert_requests_per_s", "recovery_s")
BASELINES = ("memory-radix", "lmdb-per-block")


def one(tree: str, trace: str | None, limit: int | None, work: str) -> dict:
    out_json = Path(work) / "out.json"
    argv = ["bench", "--indexes", ",".join(("sarp", *BASELINES)), "--json", str(out_json),
            "--workdir", work]
    if trace:
        argv += ["--trace", trace, "--mix-ids"]
    if limit:
        argv += ["--limit-requests", str(limit)]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    code = f"import sys; from sarp.cli import main; sys.exit(main({argv!r}))"
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                   timeout=3600, check=True)
    return json.loads(out_json.read_text())["indexes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="source tree A (its src/)")
    parser.add_argument("--b", required=True, help="source tree B")
    parser.add_argument("--trace", default=None, help="default: the built-in workload")
    parser.add_argument("--limit-requests", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    got: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    for i in range(args.repeat):
        for name in ("a", "b"):
            with tempfile.TemporaryDirectory() as work:
                indexes = one(getattr(args, name), args.trace, args.limit_requests, work)
            sarp = indexes["sarp"]
            for metric in METRICS:
                got[name].setdefault(metric, []).append(sarp[metric])
                for base in BASELINES:
                    ratio = (indexes[base][metric] / sarp[metric] if metric == "recovery_s"
                             else sarp[metric] / indexes[base][metric])
                    got[name].setdefault(f"{metric} vs {base}", []).append(ratio)
            print(f"pass {i + 1} {name}: sarp {sarp['match_requests_per_s']:,.0f} match/s",
                  flush=True)
    print(f"{'metric':<52}{'A median (range)':>26}{'B median (range)':>26}{'B/A':>7}")
    summary = {}
    for key in got["a"]:
        a, b = got["a"][key], got["b"][key]
        ma, mb = statistics.median(a), statistics.median(b)
        summary[key] = {"a": a, "b": b, "b_over_a": mb / ma}
        print(f"{key:<52}{ma:>12.4g} ({min(a):.3g}-{max(a):.3g}){mb:>12.4g} "
              f"({min(b):.3g}-{max(b):.3g}){mb / ma:>7.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"a": args.a, "b": args.b, "trace": args.trace,
                                         "repeat": args.repeat, "metrics": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
