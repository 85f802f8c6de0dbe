"""``sarp bench``: replay requests through sarp and the baselines, side by side, in one run.

Per index: replay every request (match, then insert its blocks not yet matched, as
an engine stores them after prefill).  Then the measured passes, interleaved in time
across the indexes (A, B, C, ..., then C, B, A, ...), because this machine's speed
drifts by up to 3x over minutes and only passes taken side by side compare:

* warm: ``match`` over a sample of the requests, repeated until ``pass_s`` has passed;
* batch: ``match_many`` in batches of 64 over the same sample (a baseline without it
  loops over ``match``), as a scheduler asks once per step;
* cold: drop the index's files from the page cache, then in a fresh process time
  ``open`` to the first answered match (recovery) and the first 1,000 matches.

Every figure is the median of ``passes`` passes, reported with its min and max;
ratios to sarp are the medians of the per-pass ratios.
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
from .baselines import SARP_INDEXES, VALKEY_INDEXES, dir_bytes, opener
from .traces import Request, read_requests

DEFAULT_INDEXES = ("sarp", "memory-dict", "memory-radix", "lmdb-per-block", "rocksdb-per-block")
COLD_REQUESTS = 1000
WARM_SAMPLE = 2000
BATCH = 64  # requests per match_many call: a scheduler step


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
    """Replay through one index; return it (still open), its per-request reuse and timings."""
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
    return index, {
        "reused": reused,
        "storage_reads_per_request": float(reads.mean()),
        "replay_match_requests_per_s": len(requests) / match_s,
        "insert_requests_per_s": len(requests) / insert_s,
    }


def timed_pass(one_round, requests_per_round: int, pass_s: float) -> float:
    """Requests/s of ``one_round()`` repeated until ``pass_s`` seconds have passed."""
    rounds = 0
    t0 = time.perf_counter()
    while True:
        one_round()
        rounds += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= pass_s:
            return rounds * requests_per_round / elapsed


def batch_matcher(index):
    """``index.match_many``, or a loop over ``match`` for an index without it."""
    many = getattr(index, "match_many", None)
    return many if many is not None else (lambda chains: [index.match(c) for c in chains])


def spread(values: list[float]) -> dict:
    """Median, min and max of a pass series, and the passes themselves."""
    return {"median": float(np.median(values)), "min": float(min(values)),
            "max": float(max(values)), "passes": [float(v) for v in values]}


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
    if name in VALKEY_INDEXES:
        import sarp.store_valkey  # noqa: F401  (importing the client is not recovery)
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
    if name in SARP_INDEXES:
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
    passes: int = 5,
    pass_s: float = 1.0,
) -> dict:
    """Run the whole benchmark; return the JSON-ready result.

    ``passes`` warm, batch and cold passes per index, interleaved across indexes;
    each warm and batch pass lasts at least ``pass_s`` seconds.
    """
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes={passes!r}; pass an int >= 1 (5 or more for stable medians)")
    options = options or {}
    for name in indexes:
        opener(name)  # fail fast on unknown names
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="sarp-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    exact_index, exact_run = replay("exact", requests, base / "exact", {}, progress)
    exact_index.close()
    exact = exact_run["reused"]
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
        "settings": {**options, "passes": passes, "pass_s": pass_s},
        "command": " ".join(sys.argv),
        "indexes": {},
    }
    server = None
    if any(name in VALKEY_INDEXES for name in indexes):
        from .valkey_server import ValkeyServer

        server = ValkeyServer()  # on loopback, for this run only
        options = {**options, "valkey_url": f"valkey://127.0.0.1:{server.port}"}
    try:
        _measure(result, requests, indexes, base, options, exact, queries, progress, passes,
                 pass_s)
    finally:
        if server is not None:
            server.stop()
    return result


def _options_for(name: str, options: dict) -> dict:
    """What each index takes: sarp's tunables for sarp, the server for the Valkey ones."""
    out = {k: v for k, v in options.items()
           if (name in SARP_INDEXES and k != "valkey_url") or k == "durability"
           or (k == "valkey_url" and name in VALKEY_INDEXES)}
    if name in SARP_INDEXES:
        out["progress"] = False
    return out


def _measure(result: dict, requests: list[Request], indexes: list[str], base: Path,
             options: dict, exact: np.ndarray, queries: Path, progress: bool, passes: int,
             pass_s: float) -> None:
    """Replay, then the interleaved warm, batch and cold passes; fills ``result``."""
    opened, built, folders, opts_of = {}, {}, {}, {}
    for name in indexes:
        folder = folders[name] = base / name
        shutil.rmtree(folder, ignore_errors=True)
        opts_of[name] = _options_for(name, options)
        opened[name], built[name] = replay(name, requests, folder, opts_of[name], progress)

    sample = [r.hashes for r in requests[:: max(1, len(requests) // WARM_SAMPLE)]]
    batches = [sample[i : i + BATCH] for i in range(0, len(sample), BATCH)]
    warm = {name: [] for name in indexes}
    batch = {name: [] for name in indexes}
    for name in indexes:  # warm-up, outside the timed passes
        for chain in sample[:100]:
            opened[name].match(chain)
    order = list(indexes)
    for _ in tqdm(range(passes), desc="warm passes", disable=not progress, leave=False):
        for name in order:
            index = opened[name]
            warm[name].append(timed_pass(lambda ix=index: [ix.match(c) for c in sample],
                                         len(sample), pass_s))
            many = batch_matcher(index)
            batch[name].append(timed_pass(lambda m=many: [m(b) for b in batches],
                                          len(sample), pass_s))
        order.reverse()
    stats = {}
    for name in indexes:
        st = opened[name].stats() if hasattr(opened[name], "stats") else {}
        stats[name] = {k: v for k, v in st.items() if isinstance(v, int | float | str)}
        opened[name].close()

    cold: dict[str, list[dict]] = {name: [] for name in indexes}
    order = list(indexes)
    for _ in tqdm(range(passes), desc="cold restarts", disable=not progress, leave=False):
        for name in order:
            # on Valkey the fresh process is a reader: its recovery is a reader's
            opts = {**opts_of[name], "readonly": True} if name == "sarp-valkey" else opts_of[name]
            cold[name].append(cold_restart(name, folders[name], queries, opts))
        order.reverse()

    for name in indexes:
        r, c = built[name], cold[name]
        memory = [x["exact_memory_bytes"] if x["exact_memory_bytes"] is not None
                  else max(x["rss_anon_delta_bytes"], 0) for x in c]
        reused = int(r["reused"].sum())
        result["indexes"][name] = {
            "reused_blocks": reused,
            "reuse_loss": (int(exact.sum()) - reused) / max(int(exact.sum()), 1),
            "false_positive_requests": int((r["reused"] > exact).sum()),
            "match_requests_per_s": float(np.median(warm[name])),
            "batch_match_requests_per_s": float(np.median(batch[name])),
            "cold_match_requests_per_s": float(np.median(
                [x["cold_match_requests_per_s"] for x in c])),
            "recovery_s": float(np.median([x["recovery_s"] for x in c])),
            "spread": {
                "match_requests_per_s": spread(warm[name]),
                "batch_match_requests_per_s": spread(batch[name]),
                "cold_match_requests_per_s": spread([x["cold_match_requests_per_s"]
                                                     for x in c]),
                "recovery_s": spread([x["recovery_s"] for x in c]),
            },
            "replay_match_requests_per_s": r["replay_match_requests_per_s"],
            "insert_requests_per_s": r["insert_requests_per_s"],
            "storage_reads_per_request": r["storage_reads_per_request"],
            "memory_bytes": int(np.median(memory)),
            "rss_anon_delta_bytes": int(np.median([x["rss_anon_delta_bytes"] for x in c])),
            "disk_bytes": (stats[name].get("disk_bytes", 0) if name in VALKEY_INDEXES
                           else dir_bytes(folders[name])),
            "stats": stats[name],
        }
    if "sarp" in indexes:
        result["ratios"] = ratios("sarp", indexes, warm, batch, cold)
    if "sarp-valkey" in indexes:  # sarp on Valkey against the others, sarp on LMDB included
        result["ratios_valkey"] = ratios("sarp-valkey", indexes, warm, batch, cold)


def ratios(ours: str, indexes: list[str], warm: dict, batch: dict, cold: dict) -> dict:
    """``ours`` / each other index, pass by pass (the passes were side by side in time)."""
    def per_pass(a: list[float], b: list[float]) -> dict:
        return spread([x / y for x, y in zip(a, b, strict=True)])

    cold_rate = {n: [x["cold_match_requests_per_s"] for x in cold[n]] for n in indexes}
    out: dict = {}
    for name in indexes:
        if name == ours:
            continue
        out[name] = {"warm": per_pass(warm[ours], warm[name]),
                     "cold": per_pass(cold_rate[ours], cold_rate[name]),
                     "batch": per_pass(batch[ours], batch[name]),
                     "sarp_batch_vs_warm": per_pass(batch[ours], warm[name])}
    return out


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
    """A plain-text table of the headline figures (medians), then sarp's ratios."""
    cols = ("reused", "loss %", "match/s", "batch/s", "cold match/s", "insert/s", "reads/req",
            "memory MB", "disk MB", "recovery s")
    passes = result["settings"].get("passes", 1)
    lines = [f"{result['trace']}: {result['requests']} requests, {result['blocks']} blocks, "
             f"{result['distinct_blocks']} distinct, exact reuse {result['exact_reused_blocks']}; "
             f"medians of {passes} interleaved passes",
             f"{'index':<18}" + "".join(f"{c:>14}" for c in cols)]
    for name, r in result["indexes"].items():
        row = (r["reused_blocks"], f"{100 * r['reuse_loss']:.4f}",
               f"{r['match_requests_per_s']:.0f}", f"{r['batch_match_requests_per_s']:.0f}",
               f"{r['cold_match_requests_per_s']:.0f}",
               f"{r['insert_requests_per_s']:.0f}", f"{r['storage_reads_per_request']:.2f}",
               f"{r['memory_bytes'] / 1e6:.2f}", f"{r['disk_bytes'] / 1e6:.1f}",
               f"{r['recovery_s']:.4f}")
        lines.append(f"{name:<18}" + "".join(f"{str(v):>14}" for v in row))
    for ours, key in (("sarp", "ratios"), ("sarp-valkey", "ratios_valkey")):
        for name, rs in result.get(key, {}).items():
            parts = [f"{kind} {x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f})"
                     for kind, x in rs.items() if kind != "sarp_batch_vs_warm"]
            x = rs["sarp_batch_vs_warm"]
            parts.append(f"{ours} batch / {name} warm {x['median']:.2f}x "
                         f"({x['min']:.2f}-{x['max']:.2f})")
            lines.append(f"{ours} / {name}: " + ", ".join(parts))
    return "\n".join(lines)


def plot(result: dict, out: Path) -> None:
    """Throughput (median, min-max bars), recovery time and reuse of every index, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["indexes"])
    rs = [result["indexes"][n] for n in names]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4.2))
    panels = [
        ("warm match requests/s (higher is better)", "match_requests_per_s", True),
        ("match_many in batches of 64, requests/s", "batch_match_requests_per_s", True),
        ("cold match requests/s (higher is better)", "cold_match_requests_per_s", True),
        ("recovery s, cold, fresh process (lower is better)", "recovery_s", True),
        ("reused blocks / exact", None, False),
    ]
    for ax, (title, key, log) in zip(axes, panels, strict=True):
        colors = ["#d62728" if n == "sarp" else "#7f7f7f" for n in names]
        if key is None:
            ax.bar(names, [r["reused_blocks"] / max(result["exact_reused_blocks"], 1)
                           for r in rs], color=colors)
        else:
            values = [r[key] for r in rs]
            spreads = [r.get("spread", {}).get(key) for r in rs]
            err = None
            if all(spreads):
                err = [[v - x["min"] for v, x in zip(values, spreads, strict=True)],
                       [x["max"] - v for v, x in zip(values, spreads, strict=True)]]
            ax.bar(names, values, color=colors, yerr=err, capsize=3)
        ax.set_title(title, fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=35, labelsize=8)
    passes = result["settings"].get("passes", 1)
    fig.suptitle(f"{result['trace']}: {result['requests']} requests, "
                 f"{result['distinct_blocks']} distinct blocks; medians of {passes} "
                 "interleaved passes, bars min-max")
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
