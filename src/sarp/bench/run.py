"""``sarp bench``: replay requests through sarp and the baselines, side by side, in one run.

Per index: replay every request (match, then insert its blocks not yet matched, as
an engine stores them after prefill), time a warm pass of matches, close, drop the
index's files from the page cache, and measure a cold restart in a fresh process:
from ``open`` to the first answered match, then the first 1,000 matches.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..hashing import splitmix64
from .baselines import dir_bytes, opener
from .traces import Request, read_requests

DEFAULT_INDEXES = ("sarp", "memory-dict", "memory-radix", "lmdb-per-block", "rocksdb-per-block")
COLD_REQUESTS = 1000
WARM_SAMPLE = 2000


def evict(folder: Path) -> None:
    """Drop every file below ``folder`` from the page cache (cold means cold)."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def replay(name: str, requests: list[Request], folder: Path, options: dict, progress: bool):
    """Replay through one index; return its per-request reuse and the timings."""
    index = opener(name)(folder, **options)
    reused = np.zeros(len(requests), np.int64)
    reads = np.zeros(len(requests), np.int64)
    match_s = insert_s = 0.0
    for i, req in enumerate(tqdm(requests, desc=f"replay {name}", disable=not progress,
                                 leave=False)):
        t0 = time.perf_counter()
        m = index.match(req.hashes)
        t1 = time.perf_counter()
        n = m.num_blocks
        if n < req.hashes.size:
            parent = int(req.hashes[n - 1]) if n else None
            index.insert(req.hashes[n:], parent=parent, holder="engine-0")
        insert_s += time.perf_counter() - t1
        match_s += t1 - t0
        reused[i], reads[i] = n, m.storage_reads
    sample = requests[:: max(1, len(requests) // WARM_SAMPLE)]
    for req in sample[:100]:  # warm-up
        index.match(req.hashes)
    t0 = time.perf_counter()
    for req in sample:
        index.match(req.hashes)
    warm_s = time.perf_counter() - t0
    stats = index.stats() if hasattr(index, "stats") else {}
    index.close()
    return {
        "reused": reused,
        "storage_reads_per_request": float(reads.mean()),
        "match_requests_per_s": len(sample) / warm_s,
        "replay_match_requests_per_s": len(requests) / match_s,
        "insert_requests_per_s": len(requests) / insert_s,
        "stats": {k: v for k, v in stats.items() if isinstance(v, int | float | str)},
    }


def cold_restart(name: str, folder: Path, queries: Path, options: dict) -> dict:
    """Evict the files, then time recovery and cold matches in a fresh process."""
    evict(folder)
    cmd = [sys.executable, "-m", "sarp.bench.run", "restart", name, str(folder), str(queries),
           json.dumps(options)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"restart of {name} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _restart_worker(name: str, folder: str, queries: str, options_json: str) -> None:
    with np.load(queries) as data:
        flat, offsets = data["flat"], data["offsets"]
    chains = [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    open_fn = opener(name)
    before = rss_anon_bytes()
    t0 = time.perf_counter()
    index = open_fn(Path(folder), **json.loads(options_json))
    index.match(chains[0])
    recovery_s = time.perf_counter() - t0
    memory = rss_anon_bytes() - before
    t1 = time.perf_counter()
    for chain in chains:
        index.match(chain)
    cold_s = time.perf_counter() - t1
    exact_memory = None
    if name == "sarp":
        exact_memory = index.stats()["memory_bytes"]
    index.close()  # nothing changed since the snapshot: sarp writes none on the way out
    print(json.dumps({
        "recovery_s": recovery_s,
        "cold_match_requests_per_s": len(chains) / cold_s,
        "rss_anon_delta_bytes": memory,
        "exact_memory_bytes": exact_memory,
    }))


def run(
    requests: list[Request],
    *,
    label: str,
    indexes: list[str],
    workdir: Path | None = None,
    options: dict | None = None,
    progress: bool = True,
) -> dict:
    """Run the whole benchmark; return the JSON-ready result."""
    options = options or {}
    for name in indexes:
        opener(name)  # fail fast on unknown names
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="sarp-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    exact = replay("exact", requests, base / "exact", {}, progress)["reused"]
    blocks = int(sum(r.hashes.size for r in requests))
    distinct = int(np.unique(np.concatenate([r.hashes for r in requests])).size)
    cold = requests[:COLD_REQUESTS]
    queries = base / "cold-queries.npz"
    np.savez(queries, flat=np.concatenate([r.hashes for r in cold]),
             offsets=np.cumsum([0] + [r.hashes.size for r in cold]))
    result: dict = {
        "trace": label,
        "requests": len(requests),
        "blocks": blocks,
        "distinct_blocks": distinct,
        "exact_reused_blocks": int(exact.sum()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "versions": _versions(),
        "settings": options,
        "command": " ".join(sys.argv),
        "indexes": {},
    }
    for name in indexes:
        folder = base / name
        shutil.rmtree(folder, ignore_errors=True)
        opts = options if name != "sarp" else {**options, "progress": False}
        opts = {k: v for k, v in opts.items() if name == "sarp" or k == "durability"}
        r = replay(name, requests, folder, opts, progress)
        c = cold_restart(name, folder, queries, opts)
        memory = c["exact_memory_bytes"] if c["exact_memory_bytes"] is not None else max(
            c["rss_anon_delta_bytes"], 0)
        reused = int(r["reused"].sum())
        result["indexes"][name] = {
            "reused_blocks": reused,
            "reuse_loss": (int(exact.sum()) - reused) / max(int(exact.sum()), 1),
            "false_positive_requests": int((r["reused"] > exact).sum()),
            "match_requests_per_s": r["match_requests_per_s"],
            "replay_match_requests_per_s": r["replay_match_requests_per_s"],
            "insert_requests_per_s": r["insert_requests_per_s"],
            "storage_reads_per_request": r["storage_reads_per_request"],
            "memory_bytes": int(memory),
            "rss_anon_delta_bytes": c["rss_anon_delta_bytes"],
            "disk_bytes": dir_bytes(folder),
            "recovery_s": c["recovery_s"],
            "cold_match_requests_per_s": c["cold_match_requests_per_s"],
            "stats": r["stats"],
        }
    return result


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("sarp", "numpy", "lmdb", "pyroaring", "rocksdict", "xxhash"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def table(result: dict) -> str:
    """A plain-text table of the headline figures, with ratios to sarp."""
    cols = ("reused", "loss %", "match/s", "cold match/s", "insert/s", "reads/req",
            "memory MB", "disk MB", "recovery s")
    lines = [f"{result['trace']}: {result['requests']} requests, {result['blocks']} blocks, "
             f"{result['distinct_blocks']} distinct, exact reuse {result['exact_reused_blocks']}",
             f"{'index':<18}" + "".join(f"{c:>14}" for c in cols)]
    for name, r in result["indexes"].items():
        row = (r["reused_blocks"], f"{100 * r['reuse_loss']:.4f}",
               f"{r['match_requests_per_s']:.0f}", f"{r['cold_match_requests_per_s']:.0f}",
               f"{r['insert_requests_per_s']:.0f}", f"{r['storage_reads_per_request']:.2f}",
               f"{r['memory_bytes'] / 1e6:.2f}", f"{r['disk_bytes'] / 1e6:.1f}",
               f"{r['recovery_s']:.4f}")
        lines.append(f"{name:<18}" + "".join(f"{str(v):>14}" for v in row))
    return "\n".join(lines)


def plot(result: dict, out: Path) -> None:
    """Throughput, recovery time and reuse of every index, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["indexes"])
    rs = [result["indexes"][n] for n in names]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [
        ("warm match requests/s (higher is better)", [r["match_requests_per_s"] for r in rs], True),
        ("cold match requests/s (higher is better)", [r["cold_match_requests_per_s"] for r in rs],
         True),
        ("recovery s, cold, fresh process (lower is better)", [r["recovery_s"] for r in rs], True),
        ("reused blocks / exact", [r["reused_blocks"] / max(result["exact_reused_blocks"], 1)
                                   for r in rs], False),
    ]
    for ax, (title, values, log) in zip(axes, panels, strict=True):
        colors = ["#d62728" if n == "sarp" else "#7f7f7f" for n in names]
        ax.bar(names, values, color=colors)
        ax.set_title(title, fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=35, labelsize=8)
    fig.suptitle(f"{result['trace']}: {result['requests']} requests, "
                 f"{result['distinct_blocks']} distinct blocks")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def load_requests(
    trace: str | None, split: int, limit: int | None, mix_ids: bool = False
) -> tuple[str, list[Request]]:
    """The requests to replay: a trace, or the built-in workload.

    ``mix_ids`` maps every id through :func:`sarp.hashing.splitmix64`, so that keys
    are spread like the hashes engines send instead of small sequential integers
    (which keep a request's keys side by side in a per-block B-tree).
    """
    if trace is None:
        from .workload import builtin

        reqs = builtin()
        label, reqs = "built-in workload (seed 0)", reqs[:limit] if limit else reqs
    else:
        label = Path(trace).name + (f" --split {split}" if split > 1 else "")
        reqs = list(read_requests(trace, split=split, limit=limit))
    if mix_ids:
        label += " --mix-ids"
        reqs = [Request(splitmix64(r.hashes), r.session_id) for r in reqs]
    return label, reqs


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "restart":
    _restart_worker(*sys.argv[2:])
