"""What serve's writer and its HTTP workers tell each other, through files in the
status folder (the index folder, or a folder of serve's for an index on Valkey):

* ``serve-status.json``, written by the writer every 0.5 s (atomically): the
  subscriber's counters per source and its commits, whether every source has been
  checked since start, a heartbeat, and the engines followed; read by the workers for
  ``/metrics`` (:func:`status_metrics`), ``/readyz`` and ``/workers``;
* ``registry/``, requests of the workers' ``/register`` and ``/unregister``: a worker
  writes ``<id>.json`` (atomically), the writer applies it between two polls and writes
  ``<id>.done`` with the answer, which the worker waits for and returns.

Cost: one small file write per status period; a directory scan per writer loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path

STATUS_FILE = "serve-status.json"
STATUS_FRESH_S = 10.0  # /readyz wants a writer heartbeat at most this old
REGISTRY = "registry"
ANSWER_S = 10.0  # a worker waits this long for the writer to apply a request
# The counters each source's status holds, and what each counts (in /metrics as
# sarp_source_<name>_total)
SOURCE_COUNTERS = (
    ("batches", "batches applied"), ("events", "events applied"),
    ("gaps", "sequence gaps seen"), ("replayed", "batches applied from replays"),
    ("restarts", "engine restarts detected"),
    ("unrecoverable_gaps", "gaps no replay could fill (holders cleared)"),
    ("probes", "liveness probes sent to silent engines"),
    ("gone", "engines taken as gone (no answer to a probe; holders cleared)"),
    ("bad_payloads", "batches that could not be decoded"),
    ("disconnects", "live connections dropped (engine gone, or a frame over "
                    "--max-frame-bytes)"),
    ("failed_replays", "replays over budget or without their end (holders cleared, "
                       "retried with backoff)"),
    ("bad_frames", "frames dropped (bad sequence or shape)"),
    ("hash_mismatches", "engine stores whose hashes do not follow from their tokens with "
                        "--hash-scheme and --hash-seed"))


def write_status(status_dir: Path, subscriber, *, caught_up: bool, started: float,
                 worker_restarts: int = 0, engines=(), deal_errors: int = 0,
                 file_errors: int = 0) -> None:
    """Write the subscriber's counters for the workers' ``/metrics`` and ``/readyz``;
    with ``subscriber`` None (serve starting), no counters yet and ``engines`` (the
    sources to follow) as the engines followed."""
    now = time.time()
    sources = {}
    for key, summary in (subscriber.summary() if subscriber else {}).items():
        applied = summary.pop("applied")
        last = subscriber.last_applied_at.get(key)
        sources[key] = {**summary, "events": applied["events"],
                        "bad_events": dict(applied["bad_events"]),
                        "skipped_orphans": applied["skipped_orphans"],
                        "seconds_since_last_applied": None if last is None else now - last}
    status = {"pid": os.getpid(), "started": started, "heartbeat": now,
              "caught_up": caught_up, "sources": sources,
              "engines": [asdict(s) for s in
                          (subscriber.sources.values() if subscriber else engines)],
              "http_worker_restarts": worker_restarts, "http_deal_errors": deal_errors,
              "file_errors": file_errors,
              "store_errors": getattr(subscriber, "store_errors", 0),
              "commits": subscriber.applier.commits if subscriber else 0,
              "commit_seconds": subscriber.applier.commit_seconds if subscriber else 0.0}
    tmp = status_dir / (STATUS_FILE + ".tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, status_dir / STATUS_FILE)


def read_status(status_dir: Path) -> dict | None:
    """The writer's last status, or None (not written yet, or being replaced)."""
    try:
        return json.loads((status_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def readiness(status: dict | None) -> dict:
    """``GET /readyz``'s body: ready when every source has been caught up since serve
    started and the writer's heartbeat is fresh; and the engines whose hashes
    token-id queries cannot find (the index is fine)."""
    fresh = status is not None and time.time() - status["heartbeat"] < STATUS_FRESH_S
    return {"ready": bool(fresh and status["caught_up"]),
            "caught_up": bool(status and status["caught_up"]),
            "writer_heartbeat_fresh": bool(fresh),
            "hash_mismatches": {key: s["hash_note"] for key, s in
                                (status or {}).get("sources", {}).items()
                                if s.get("hash_mismatches")}}


def workers_listed(status: dict | None) -> list[dict]:
    """``GET /workers``'s body, in Dynamo's shape: ``[{"instance_id": 1, "model_name":
    ..., "endpoints": {"0": ...}}]``, one entry per engine and model, its DP ranks'
    endpoints together."""
    listed: dict[tuple, dict] = {}
    for e in (status or {}).get("engines", []):
        n = e["name"]
        entry = listed.setdefault((n, e.get("model")), {
            "instance_id": int(n) if n.isdigit() else n, "source": "zmq", "status": "active",
            "model_name": e.get("model"), "routing_group": e.get("tenant"),
            "block_size": e.get("block_size"), "endpoints": {}})
        entry["endpoints"][str(e["dp_rank"] or 0)] = e["endpoint"]
    return [listed[k] for k in sorted(listed, key=str)]


def running_serve(index: str) -> dict | None:
    """The counters of the ``sarp serve`` writing the folder index ``index`` now, from
    its status file (for ``sarp stats``); None when no serve runs there (or the index
    is on Valkey, whose serve keeps its status in a folder of its own).

    >>> running_serve("valkey://127.0.0.1:6379/ns") is None
    True
    """
    if "://" in index:
        return None
    status = read_status(Path(index))
    if status is None or time.time() - status.get("heartbeat", 0) > STATUS_FRESH_S:
        return None
    try:
        os.kill(status["pid"], 0)
    except (OSError, KeyError, TypeError):
        return None
    status.pop("engines", None)
    status["heartbeat_age_s"] = round(time.time() - status.pop("heartbeat"), 3)
    return status


def submit(status_dir: Path, request: dict, timeout_s: float = ANSWER_S) -> dict:
    """A worker's side: hand ``request`` to the writer and wait for its answer (a dict
    with ``status`` and the body), or a 503 answer when none comes within
    ``timeout_s``.  Blocking: call it off the event loop."""
    folder = status_dir / REGISTRY
    folder.mkdir(exist_ok=True)
    name = uuid.uuid4().hex
    tmp = folder / f"{name}.tmp"
    tmp.write_text(json.dumps(request))
    os.replace(tmp, folder / f"{name}.json")
    done = folder / f"{name}.done"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = json.loads(done.read_text())
        except (OSError, ValueError):
            time.sleep(0.01)
            continue
        done.unlink(missing_ok=True)
        return answer
    with contextlib.suppress(OSError):
        (folder / f"{name}.json").unlink()  # not taken: withdrawn
    return {"status": 503, "body": {"error": "the writer did not answer in "
                                             f"{timeout_s:.0f} s; try again",
                                    "field": "writer"}}


_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def registration_problem(obj: object, op: str) -> tuple[str, str] | None:
    """What is wrong with a ``/register`` or ``/unregister`` body (in the shapes of
    Dynamo's standalone indexer and Mooncake RFC #1403), as ``(field, message)``; None
    when nothing is.

    >>> registration_problem({"instance_id": 1, "endpoint": "tcp://10.0.0.5:5557"}, "register")
    >>> registration_problem({"instance_id": 1}, "register")[0]
    'endpoint'

    With ``model_name`` (and ``block_size``, and optionally ``routing_group`` or
    ``tenant_id``) the engine's blocks are keyed by their tokens, for ``/query``.
    """
    if not isinstance(obj, dict):
        return "body", 'send a JSON object, e.g. {"instance_id": 1, "endpoint": "tcp://H:P"}'
    iid = obj.get("instance_id")
    if not (type(iid) is int and iid >= 0 or isinstance(iid, str) and iid
            and not set(iid) & set("#=,") and len(iid) <= 100):
        return "instance_id", (f"instance_id={iid!r}; pass an int >= 0 or a name without "
                               "#, = or ,")
    rank = obj.get("dp_rank")
    if rank is not None and not (type(rank) is int and 0 <= rank <= 4095):
        return "dp_rank", f"dp_rank={rank!r}; pass an int from 0 to 4095"
    for field in ("model_name", "routing_group", "tenant_id"):
        value = obj.get(field)
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= 200):
            return field, f"{field}={value!r}; pass a name of 1 to 200 characters"
    if op == "register":
        for field, needed in (("endpoint", True), ("replay_endpoint", False)):
            value = obj.get(field)
            if (value is not None or needed) and not (
                    isinstance(value, str) and value.startswith(_ENDPOINT_SCHEMES)):
                return field, (f"{field}={value!r}; pass the engine's ZeroMQ endpoint, e.g. "
                               "tcp://10.0.0.5:5557")
        size = obj.get("block_size")
        if (size is not None or obj.get("model_name") is not None) and not (
                type(size) is int and 0 < size <= 0xFFFF):
            return "block_size", (f"block_size={size!r}; with a model_name, pass the "
                                  "engine's block size (tokens per block, 1 to 65535)")
    return None


def take(status_dir: Path) -> list[tuple[Path, dict]]:
    """The writer's side: the requests waiting, oldest first, each taken (renamed) so
    that a worker that gave up cannot withdraw it half-applied."""
    folder = status_dir / REGISTRY
    try:  # (scandir: serve asks after every poll, and a glob cost 3x as much)
        with os.scandir(folder) as entries:
            waiting = [(e.stat().st_mtime_ns, e.path) for e in entries if e.name.endswith(".json")]
    except OSError:
        return []
    names = [Path(path) for _, path in sorted(waiting)]
    out = []
    for path in names:
        taken = path.with_suffix(".taken")
        try:
            os.replace(path, taken)
            out.append((taken, json.loads(taken.read_text())))
        except (OSError, ValueError):
            continue
    return out


def answer(taken: Path, status: int, body: object) -> None:
    """The writer's answer to a taken request."""
    tmp = taken.with_suffix(".done.tmp")
    tmp.write_text(json.dumps({"status": status, "body": body}))
    os.replace(tmp, taken.with_suffix(".done"))
    taken.unlink(missing_ok=True)


def status_metrics(status: dict | None):
    """``/metrics``' families from the writer's status (:func:`read_status`), as data
    for the HTTP side to render: ``(name, "counter" or "gauge", help, label names,
    [(label values, value)])`` each.  Cost: a pass over the sources."""
    status = status or {"sources": {}, "caught_up": False}
    sources = status["sources"]
    for name, text in SOURCE_COUNTERS:
        yield (f"sarp_source_{name}", "counter", text, ["source"],
               [([key], s.get(name, 0)) for key, s in sources.items()])
    yield ("sarp_source_bad_events", "counter", "bad events skipped, by kind",
           ["source", "kind"], [([key, kind], count) for key, s in sources.items()
                                for kind, count in s.get("bad_events", {}).items()])
    age = time.time() - status.get("heartbeat", time.time())
    yield ("sarp_source_seconds_since_last_applied", "gauge",
           "seconds since the source's last applied batch", ["source"],
           [([key], s["seconds_since_last_applied"] + age) for key, s in sources.items()
            if s.get("seconds_since_last_applied") is not None])
    yield ("sarp_ready", "gauge", "every source caught up since start", [],
           [([], 1.0 if status.get("caught_up") else 0.0)])
    for name, key, text in (
            ("sarp_http_worker_restarts", "http_worker_restarts",
             "HTTP workers that died or hung and were replaced"),
            ("sarp_http_deal_errors", "http_deal_errors", "HTTP connections not accepted "
             "or not handed to a worker (out of descriptors or memory)"),
            ("sarp_file_errors", "file_errors",
             "writes of serve's status and registry files that failed and were made again"),
            ("sarp_commits", "commits", "index transactions of engines' events"),
            ("sarp_commit_seconds", "commit_seconds", "time serve spent in them"),
            ("sarp_store_errors", "store_errors",
             "writes to the index that failed and were retried")):
        yield name, "counter", text, [], [([], status.get(key, 0))]
