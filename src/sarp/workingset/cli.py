"""``sarp workingset``: the hit-rate curve of a trace, the capacity for each target,
JSON and a plot."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..bench.traces import read_requests
from .analyzer import HitCurve, WorkingSet, analyze


def run(args: argparse.Namespace) -> int:
    for value in [*args.target, *args.target_abs]:
        if not 0 < value <= 1:
            print(f"sarp workingset: target {value} must be a fraction in (0, 1]", file=sys.stderr)
            return 2
    started = time.perf_counter()
    requests = [r.hashes for r in read_requests(args.trace, split=args.split,
                                                limit=args.limit_requests)]
    progress = True  # bars on stderr, also in a log: a long pass says where it is
    if args.sample_rate is None and args.sample_size is None:
        curve = analyze(requests, progress=progress)
        memory = None
    else:
        ws = WorkingSet(sample_rate=args.sample_rate or 1.0, sample_size=args.sample_size)
        for chain in requests:
            ws.observe(chain)
        curve, memory = ws.curve(), ws.nbytes()
    result = report(curve, args, time.perf_counter() - started, memory)
    print(summary(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result))
    if args.plot:
        plot(curve, result, args.plot)
    return 0


def report(curve: HitCurve, args: argparse.Namespace, seconds: float, memory: int | None) -> dict:
    def sized(blocks: int) -> dict:
        out: dict = {"capacity_blocks": blocks}
        if args.block_tokens:
            out["capacity_tokens"] = blocks * args.block_tokens
        if args.bytes_per_block:
            out["capacity_bytes"] = blocks * args.bytes_per_block
        return out

    targets = []
    for kind, values in (("fraction_of_unbounded", args.target), ("absolute", args.target_abs)):
        for value in values:
            rate = value * curve.unbounded_hit_rate if kind != "absolute" else value
            capacity = curve.capacity_for(rate)
            targets.append({"target": value, "kind": kind, "hit_rate": rate,
                            **(sized(capacity) if capacity is not None
                               else {"capacity_blocks": None})})
    return {
        "trace": Path(args.trace).name + (f" --split {args.split}" if args.split > 1 else ""),
        "requests": curve.requests,
        "accesses": int(round(curve.accesses)),
        "unbounded_hit_rate": curve.unbounded_hit_rate,
        "sample_rate": curve.sample_rate,
        "sampler_memory_bytes": memory,
        "seconds": seconds,
        "command": " ".join(sys.argv),
        "targets": targets,
        "curve": [{**sized(p["capacity_blocks"]), "hit_rate": p["hit_rate"]}
                  for p in curve.points()],
    }


def summary(result: dict) -> str:
    lines = [f"{result['trace']}: {result['requests']} requests, {result['accesses']} block "
             f"accesses, unbounded hit rate {result['unbounded_hit_rate']:.4f} "
             f"({len(result['curve'])} curve points, {result['seconds']:.1f} s)"]
    for t in result["targets"]:
        what = (f"{t['target']:.0%} of unbounded" if t["kind"] != "absolute"
                else f"absolute {t['target']:.2f}")
        blocks = t["capacity_blocks"]
        where = f"{blocks:,} blocks" if blocks is not None else "unreachable"
        lines.append(f"  {what} (hit rate {t['hit_rate']:.4f}): {where}")
    return "\n".join(lines)


def plot(curve: HitCurve, result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    capacities = np.array([p["capacity_blocks"] for p in result["curve"]])
    rates = np.array([p["hit_rate"] for p in result["curve"]])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.step(capacities, rates, where="post", color="#d62728")
    ax.axhline(curve.unbounded_hit_rate, color="#7f7f7f", linestyle="--", linewidth=1,
               label=f"unbounded {curve.unbounded_hit_rate:.3f}")
    for t in result["targets"]:
        if t["capacity_blocks"]:
            ax.plot([t["capacity_blocks"]], [t["hit_rate"]], "o", color="black")
            ax.annotate(f"{t['capacity_blocks']:,}", (t["capacity_blocks"], t["hit_rate"]),
                        textcoords="offset points", xytext=(5, -12), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("LRU cache capacity (blocks)")
    ax.set_ylabel("prefix hit rate (reusable blocks / blocks requested)")
    ax.set_title(result["trace"])
    ax.legend(loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
