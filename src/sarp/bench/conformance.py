"""The same engines feeding ``sarp serve`` and Dynamo's standalone indexer, the same
Mooncake RFC #1403 requests asked of both, and the answers compared.

The engines are simulated from the real traces (:mod:`sarp.bench.traces`): each
trace block becomes ``BLOCK_SIZE`` tokens made from its id (requests that share a
block share its tokens), and every engine hashes a block the same way (vLLM's hashes
with a fixed seed are the same on every engine).  An engine (one DP rank) has a GPU
cache and a CPU cache, both LRU: a request reuses its longest GPU prefix, stores the
rest (one ``BlockStored`` with the tokens), evicts beyond its capacity (``BlockRemoved``),
offloads what it evicts to CPU when the block's parent is still cached there or on
GPU (a ``BlockStored`` with medium ``CPU`` and the tokens), and evicts CPU blocks in
turn.  Events go out in vLLM 0.11's and 0.33's encodings, some under a LoRA adapter,
and one engine clears its cache half way.  Each engine publishes on an XPUB (so that
the run starts only once both services subscribe) with a replay ROUTER beside it.

:func:`compare` asks both services the same requests and lists every difference.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zmq

from ..hashing import splitmix64
from ..tokenkeys import token_keys
from .cluster import EnginePublisher

BLOCK_SIZE = 16
VOCAB = 151_936  # token ids below this, as a real vocabulary's (Qwen2's): at most 6 digits
ENGINE_SEED = np.uint64(0x5A17)  # the engines' shared hash seed


def block_tokens(ids: np.ndarray) -> np.ndarray:
    """``BLOCK_SIZE`` tokens per trace block id, made from the id: ids of a real
    vocabulary's range (``VOCAB``), so a request's JSON is as long as an engine's.
    Random 32-bit ids (10 digits) had made every body about twice as long."""
    ids = np.asarray(ids, np.uint64)
    grid = ids[:, None] * np.uint64(BLOCK_SIZE) + np.arange(BLOCK_SIZE, dtype=np.uint64)
    return (splitmix64(grid.ravel()) % np.uint64(VOCAB)).astype(np.uint32)


def engine_hashes(ids: np.ndarray, lora: str | None = None) -> np.ndarray:
    """The engines' hash of each trace block (the same on every engine; under a LoRA
    adapter another, as vLLM's hash takes the adapter in)."""
    salt = ENGINE_SEED if lora is None else ENGINE_SEED ^ np.uint64(0x10FA << 32)
    return splitmix64(np.asarray(ids, np.uint64) ^ salt)


class Publisher(EnginePublisher):
    """:class:`EnginePublisher` on an XPUB, which tells when subscribers arrive, and
    with no send limit on its replay ROUTER (vLLM 0.11 keeps ZeroMQ's 1,000 frames,
    so a replay of more than that to a slow reader loses some: Dynamo's indexer
    rebuilding from 1,500 batches an engine missed parents for good)."""

    def _open(self, endpoint: str, replay_endpoint: str) -> None:
        # the sockets set up before the replay thread starts (a socket is one thread's)
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(endpoint)  # loopback, a port of its own (tcp://127.0.0.1:*)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.bind(replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def wait_subscribers(self, count: int, timeout_s: float = 20.0) -> None:
        seen, deadline = 0, time.monotonic() + timeout_s
        while seen < count:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pub.poll(int(left * 1000)):
                raise TimeoutError(f"{self.endpoint}: {seen} of {count} subscribers came")
            seen += self.pub.recv()[:1] == b"\x01"


@dataclass
class Engine:
    """One engine rank: its caches, the events it publishes, in its encoding."""

    iid: int
    rank: int
    model: str
    style: str
    publisher: Publisher
    gpu_blocks: int = 1500
    cpu_blocks: int = 3000
    gpu: OrderedDict = field(default_factory=OrderedDict)  # block id -> parent id
    cpu: OrderedDict = field(default_factory=OrderedDict)

    def serve(self, ids: np.ndarray, lora: str | None = None) -> None:
        """One request: a batch of its store, evictions and offloads."""
        chain = [(int(i), lora) for i in ids.tolist()]
        hit = 0
        while hit < len(chain) and chain[hit] in self.gpu:
            hit += 1
        events = []
        if hit < len(chain):
            parent = chain[hit - 1] if hit else None
            events.append(self._stored(chain[hit:], parent, "GPU"))
        for j in range(len(chain) - 1, -1, -1):  # last first: parents stay more recent
            self.gpu[chain[j]] = chain[j - 1] if j else None
            self.gpu.move_to_end(chain[j])
        evicted = []
        while len(self.gpu) > self.gpu_blocks:
            evicted.append(self.gpu.popitem(last=False))
        if evicted:
            events.append(("removed", [b for b, _ in evicted], "GPU"))
        for block, parent in evicted:
            if block not in self.cpu and (parent is None or parent in self.gpu
                                          or parent in self.cpu):
                events.append(self._stored([block], parent, "CPU"))
                self.cpu[block] = parent
        dropped = []
        while len(self.cpu) > self.cpu_blocks:
            dropped.append(self.cpu.popitem(last=False)[0])
        if dropped:
            events.append(("removed", dropped, "CPU"))
        self._publish(events)

    def clear(self) -> None:
        self.gpu.clear()
        self.cpu.clear()
        self._publish([("cleared",)])

    def _stored(self, blocks: list, parent, medium: str) -> tuple:
        return ("stored", blocks, parent, medium)

    def _publish(self, events: list[tuple]) -> None:
        self.publisher.publish(encode(events, self.style, self.rank))


def encode(events: list[tuple], style: str, rank: int) -> bytes:
    """A batch in vLLM 0.11's (tagged arrays) or 0.33's (tagged maps) encoding; blocks
    are ``(trace id, lora name)``."""
    out = []
    for e in events:
        if e[0] == "cleared":
            out.append(["AllBlocksCleared"] if style == "vllm-0.11"
                       else {"type": "AllBlocksCleared"})
            continue
        ids, lora = np.array([b for b, _ in e[1]], np.uint64), e[1][0][1]
        under = np.array([b[1] is not None for b in e[1]])
        hashes = np.where(under, engine_hashes(ids, LORA), engine_hashes(ids)).tolist()
        medium = e[3] if e[0] == "stored" else e[2]
        if e[0] == "removed":
            out.append(["BlockRemoved", hashes, medium] if style == "vllm-0.11"
                       else {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium})
            continue
        parent = None if e[2] is None else int(engine_hashes(np.array([e[2][0]]), lora)[0])
        tokens = block_tokens(ids).tolist()
        if style == "vllm-0.11":
            out.append(["BlockStored", hashes, parent, tokens, BLOCK_SIZE, None, medium, lora])
        else:
            out.append({"type": "BlockStored", "block_hashes": hashes,
                        "parent_block_hash": parent, "token_ids": tokens,
                        "block_size": BLOCK_SIZE, "medium": medium, "lora_name": lora})
    return msgpack.packb([time.time(), out, rank])


# instance id, model, DP ranks, encoding
INSTANCES = ((1, "llama", 2, "vllm-0.33"), (2, "llama", 1, "vllm-0.11"),
             (3, "qwen", 1, "vllm-0.33"), (4, "qwen", 2, "vllm-0.11"))
LORA = "sql-adapter"  # instance 2 serves some requests under it


def engines(context: zmq.Context) -> list[Engine]:
    return [Engine(iid, rank, model, style, Publisher(context, name=f"e{iid}-{rank}"))
            for iid, model, ranks, style in INSTANCES for rank in range(ranks)]


def registrations(engine_list: Sequence[Engine]) -> list[dict]:
    """The ``/register`` bodies of the engines (both services take them)."""
    return [{"instance_id": e.iid, "endpoint": e.publisher.endpoint,
             "replay_endpoint": e.publisher.replay_endpoint, "model_name": e.model,
             "block_size": BLOCK_SIZE, "dp_rank": e.rank} for e in engine_list]


def drive(engine_list: Sequence[Engine], requests: Sequence[np.ndarray], seed: int = 1) -> None:
    """Serve ``requests``: each on one engine of one model (by its first block, so that
    prefixes come back to the same engine), half of them on the other model too; one
    in five on instance 2 under the LoRA adapter; instance 2 clears half way."""
    rng = random.Random(seed)
    by_model: dict[str, list[Engine]] = {}
    for e in engine_list:
        by_model.setdefault(e.model, []).append(e)
    for n, ids in enumerate(requests):
        if not ids.size:
            continue
        first = int(ids[0])
        models = ["llama", "qwen"] if rng.random() < 0.5 else [rng.choice(["llama", "qwen"])]
        for model in models:
            pool = by_model[model]
            engine = pool[(first * 7 + len(model)) % len(pool)]
            lora = LORA if engine.iid == 2 and rng.random() < 0.2 else None
            engine.serve(ids, lora)
        if n == len(requests) // 2:
            for e in engine_list:
                if e.iid == 2:
                    e.clear()


def marker_ids(engine: Engine) -> np.ndarray:
    """A block id no trace has, for the last batch of an engine."""
    return np.array([(1 << 60) + 7919 * engine.iid + engine.rank], np.uint64)


def queries(requests: Sequence[np.ndarray], count: int, seed: int = 2) -> list[tuple[str, dict]]:
    """``count`` requests for both services: ``/query`` with a request's tokens (a
    prefix of it, or it whole, with a partial last block), or ``/query_by_hash`` with
    the RFC's per-block hashes; for either model, some under the LoRA adapter, and a
    few for a model nobody serves."""
    rng = random.Random(seed)
    out: list[tuple[str, dict]] = []
    live = [r for r in requests if r.size]
    while len(out) < count:
        ids = rng.choice(live)
        cut = ids[: rng.randrange(1, ids.size + 1)] if rng.random() < 0.3 else ids
        tokens = block_tokens(cut)
        model = rng.choice(["llama", "qwen", "llama", "qwen", "mistral"]) \
            if rng.random() < 0.05 else rng.choice(["llama", "qwen"])
        lora = LORA if model == "llama" and rng.random() < 0.15 else None
        if rng.random() < 0.25 and lora is None:
            local = token_keys(tokens, BLOCK_SIZE, parent=0)[1]
            signed = local.astype(np.int64).tolist()  # the RFC's hashes are i64
            out.append(("/query_by_hash", {"block_hashes": signed, "model_name": model}))
            continue
        extra = [rng.randrange(1 << 17) for _ in range(rng.randrange(BLOCK_SIZE))]
        body = {"token_ids": tokens.tolist() + extra, "model_name": model}
        if lora:
            body["lora_name"] = lora
        out.append(("/query", body))
    return out


def post(url: str, path: str, body: dict | bytes, timeout_s: float = 30.0
         ) -> tuple[int, object]:
    """POST ``body`` (an object as JSON, or bytes as they are); the status and the
    answer's JSON (its text when it is not JSON)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def compare(sarp_url: str, dynamo_url: str, asked: Sequence[tuple[str, dict]]
            ) -> tuple[list[dict], dict]:
    """Ask both; return the differences (status, or the answer when both are 200) and
    counts of what was asked and matched, and of sarp's answers that named an
    instance of another model (``other_model``)."""
    owners: dict[str, set[str]] = {}
    for iid, model, _, _ in INSTANCES:
        owners.setdefault(model, set()).add(str(iid))
    differences = []
    counts = {"asked": 0, "answered": 0, "with_hits": 0, "not_found": 0, "other_model": 0}
    for path, body in asked:
        got_sarp, got_dyn = post(sarp_url, path, body), post(dynamo_url, path, body)
        counts["asked"] += 1
        if got_sarp[0] == 200:
            named = set(got_sarp[1]["instances"]) | set(got_sarp[1]["scores"])
            counts["other_model"] += bool(named - owners.get(body["model_name"], set()))
        same = got_sarp[0] == got_dyn[0] and (got_sarp[0] != 200 or got_sarp[1] == got_dyn[1])
        if got_dyn[0] == 200:
            counts["answered"] += 1
            counts["with_hits"] += bool(got_dyn[1].get("instances"))
        elif got_dyn[0] == 404:
            counts["not_found"] += 1
        if not same:
            differences.append({"path": path, "body": body, "sarp": got_sarp,
                                "dynamo": got_dyn})
    return differences, counts


def wait_for_markers(urls: Sequence[str], engine_list: Sequence[Engine],
                     timeout_s: float = 120.0, publish: bool = True) -> None:
    """Publish each engine's marker (unless ``publish`` is False: done already) and
    wait until both services answer it: every batch before it has been applied by then
    (an engine's batches are in order)."""
    for e in engine_list if publish else ():
        e.serve(marker_ids(e))
    deadline = time.monotonic() + timeout_s
    for e in engine_list:
        body = {"token_ids": block_tokens(marker_ids(e)).tolist(), "model_name": e.model}
        for url in urls:
            while True:
                status, got = post(url, "/query", body)
                if status == 200 and str(e.rank) in got.get("scores", {}).get(str(e.iid), {}):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not apply engine {e.iid}#{e.rank}'s "
                                       f"batches within {timeout_s:.0f} s ({status}: {got})")
                time.sleep(0.005)
