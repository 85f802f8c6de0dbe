"""Render docs/performance.md's tables from ``sarp bench --json`` results.

    .venv/bin/python benchmarks/tables.py bench-results/mooncake.json [more.json ...]

Prints, per result file, the per-index table and sarp's ratios to each baseline
(same run), in Markdown.
"""

from __future__ import annotations

import json
import sys

BASELINES = ("memory-dict", "memory-radix", "lmdb-per-block", "rocksdb-per-block")


def mb(value: float) -> str:
    return f"{value / 1e6:,.2f} MB"


def render(result: dict) -> str:
    lines = [
        f"### {result['trace']}",
        "",
        f"{result['requests']:,} requests, {result['blocks']:,} blocks, "
        f"{result['distinct_blocks']:,} distinct; exact reuse {result['exact_reused_blocks']:,} "
        f"blocks. Command: `{result['command']}`",
        "",
        "| index | reused blocks | loss | warm match req/s | cold match req/s | insert req/s "
        "| reads/req | memory | disk | recovery |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["indexes"].items():
        lines.append(
            f"| {name} | {r['reused_blocks']:,} | {100 * r['reuse_loss']:.4f}% "
            f"| {r['match_requests_per_s']:,.0f} | {r['cold_match_requests_per_s']:,.0f} "
            f"| {r['insert_requests_per_s']:,.0f} | {r['storage_reads_per_request']:,.2f} "
            f"| {mb(r['memory_bytes'])} | {mb(r['disk_bytes'])} | {1e3 * r['recovery_s']:,.1f} ms |"
        )
    sarp = result["indexes"].get("sarp")
    present = [b for b in BASELINES if b in result["indexes"]]
    if sarp and present:
        lines += ["", "sarp against each baseline, same run:", "",
                  "| | " + " | ".join(present) + " |", "|---|" + "---|" * len(present)]
        rows = [
            ("warm match", lambda b: sarp["match_requests_per_s"] / b["match_requests_per_s"]),
            ("cold match",
             lambda b: sarp["cold_match_requests_per_s"] / b["cold_match_requests_per_s"]),
            ("recovery, faster by", lambda b: b["recovery_s"] / sarp["recovery_s"]),
            ("memory, sarp's share", lambda b: sarp["memory_bytes"] / max(b["memory_bytes"], 1)),
        ]
        for label, ratio in rows:
            cells = " | ".join(f"{ratio(result['indexes'][b]):,.3g}x" for b in present)
            lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            print(render(json.load(f)))
            print()
