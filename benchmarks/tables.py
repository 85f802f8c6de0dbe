"""Render docs/performance.md's tables from ``sarp bench --json`` results.

    .venv/bin/python benchmarks/tables.py bench-results/mooncake.json [more.json ...]

Prints, per result file, the per-index table and sarp's ratios to each baseline
(same run), in Markdown.
"""

from __future__ import annotations

import json
import sys

BASELINES = ("memory-dict", "memory-radix", "lmdb-per-block", "rocksdb-per-block",
             "valkey-per-block", "sarp")


def mb(value: float) -> str:
    return f"{value / 1e6:,.2f} MB"


def rate(r: dict, key: str) -> str:
    """A median rate, with the min-max of its passes when the result has them."""
    s = r.get("spread", {}).get(key)
    text = f"{r[key]:,.0f}"
    return text if s is None else f"{text} ({s['min']:,.0f}-{s['max']:,.0f})"


def render(result: dict) -> str:
    passes = result.get("settings", {}).get("passes", 1)
    lines = [
        f"### {result['trace']}",
        "",
        f"{result['requests']:,} requests, {result['blocks']:,} blocks, "
        f"{result['distinct_blocks']:,} distinct; exact reuse {result['exact_reused_blocks']:,} "
        f"blocks; medians of {passes} interleaved passes (min-max). "
        f"Command: `{result['command']}`",
        "",
        "| index | reused blocks | loss | warm match req/s | match_many req/s | cold match req/s "
        "| insert req/s | reads/req | memory | disk | recovery |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["indexes"].items():
        lines.append(
            f"| {name} | {r['reused_blocks']:,} | {100 * r['reuse_loss']:.4f}% "
            f"| {rate(r, 'match_requests_per_s')} | {rate(r, 'batch_match_requests_per_s')} "
            f"| {rate(r, 'cold_match_requests_per_s')} "
            f"| {r['insert_requests_per_s']:,.0f} | {r['storage_reads_per_request']:,.2f} "
            f"| {mb(r['memory_bytes'])} | {mb(r['disk_bytes'])} | {1e3 * r['recovery_s']:,.1f} ms |"
        )
    for ours, key in (("sarp", "ratios"), ("sarp-valkey", "ratios_valkey")):
        table = result.get(key, {})
        present = [b for b in BASELINES if b in table]
        if not present:
            continue
        lines += ["", f"{ours} against each index, pass by pass in the same run (median, "
                  "min-max):", "", "| | " + " | ".join(present) + " |",
                  "|---|" + "---|" * len(present)]
        for label, kind in (("warm match", "warm"), ("cold match", "cold"),
                            ("match_many / its match_many", "batch"),
                            (f"{ours} match_many / their warm match", "sarp_batch_vs_warm")):
            cells = " | ".join(f"{table[b][kind]['median']:.2f}x ({table[b][kind]['min']:.2f}-"
                               f"{table[b][kind]['max']:.2f})" for b in present)
            lines.append(f"| {label} | {cells} |")
        us = result["indexes"][ours]
        cells = " | ".join(f"{result['indexes'][b]['recovery_s'] / us['recovery_s']:,.3g}x"
                           for b in present)
        lines.append(f"| recovery, faster by | {cells} |")
        shares = [us["memory_bytes"] / max(result["indexes"][b]["memory_bytes"], 1)
                  for b in present]
        cells = " | ".join(f"{x:,.3g}x" for x in shares)
        lines.append(f"| memory, {ours}'s share | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            print(render(json.load(f)))
            print()
