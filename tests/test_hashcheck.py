"""serve checks that the engines hash blocks as it hashes token ids (issue 25, item 4):
real serve processes, an engine publishing vLLM 0.33 events whose hashes follow from
their tokens in one scheme; a mismatch is reported within the first batch, naming the
scheme and seed that match, in /readyz and /metrics."""

from __future__ import annotations

import random
import time

import zmq
from servekit import Serve, call, match, source_metric

import sarp
from sarp.bench.cluster import EnginePublisher
from sarp.serving.events import encode_batch
from sarp.serving.hashcheck import HashCheck


def publish_one(pub: EnginePublisher, scheme: str, seed: str | None) -> list[int]:
    """One batch: a store starting a chain, its hashes made from its tokens."""
    rng = random.Random(5)
    tokens = [rng.randrange(150_000) for _ in range(48)]
    hashes = sarp.hash_blocks(tokens, 16, scheme=scheme, seed=seed).tolist()
    pub.publish(encode_batch([("stored", hashes, None, "GPU")], ts=time.time(), dp_rank=0,
                             style="vllm-0.33", token_ids=[tokens]))
    return tokens


def run(tmp_path, engine_scheme: str, engine_seed: str | None, *serve_args: str) -> tuple:
    pub = EnginePublisher(zmq.Context.instance())
    try:
        spec = f"e={pub.endpoint},{pub.replay_endpoint}"
        with Serve(tmp_path / "ix", [spec], *serve_args) as serve:
            serve.wait_ready()
            tokens = publish_one(pub, engine_scheme, engine_seed)
            serve.wait_for(lambda: call(serve.port, "GET", "/readyz")[1].get("hash_mismatches")
                           or source_metric(serve.port, "batches", "e") >= 1,
                           what="the first batch")
            time.sleep(1.0)  # the status file the workers read is rewritten every 0.5 s
            ready = call(serve.port, "GET", "/readyz")[1]
            mismatches = source_metric(serve.port, "hash_mismatches", "e")
            _, answer = match(serve.port, {"token_ids": tokens, "block_size": 16})
            return ready, mismatches, answer["matched_blocks"], serve.log.read_text()
    finally:
        pub.close()


def test_a_scheme_mismatch_is_reported_within_the_first_batch(tmp_path):
    # vLLM's sha256_cbor with PYTHONHASHSEED=0 on the engine; serve on its defaults
    ready, mismatches, matched, log = run(tmp_path, "vllm-sha256-cbor", "0")
    assert mismatches == 1
    note = ready["hash_mismatches"]["e"]
    assert "--hash-scheme vllm-sha256-cbor --hash-seed 0" in note, note
    assert matched == 0  # what the check warns of: token-id queries find nothing
    assert "do not follow from its tokens" in log and ready["ready"]


def test_matching_schemes_report_nothing_and_token_queries_match(tmp_path):
    ready, mismatches, matched, _ = run(tmp_path, "vllm-sha256-cbor", "0",
                                        "--hash-scheme", "vllm-sha256-cbor", "--hash-seed", "0")
    assert (mismatches, ready["hash_mismatches"], matched) == (0, {}, 3)


def test_the_default_scheme_matches_a_default_vllm(tmp_path):
    # vLLM 0.33 on its defaults: sha256, no PYTHONHASHSEED (the seed "vllm-none-hash")
    ready, mismatches, matched, _ = run(tmp_path, "vllm-sha256", "vllm-none-hash")
    assert (mismatches, ready["hash_mismatches"], matched) == (0, {}, 3)


def test_the_check_names_each_known_scheme_or_none():
    tokens = list(range(100, 164))
    for scheme, seed in (("vllm-sha256", "0"), ("vllm-xxhash-cbor", "0"), ("sglang", None),
                         ("xxh3", None)):
        hashes = sarp.hash_blocks(tokens, 16, scheme=scheme, seed=seed)
        ok, note = HashCheck("vllm-sha256-cbor", "7").verdict([(hashes, tokens, 16)])
        assert not ok and f"--hash-scheme {scheme}" in note, (scheme, note)
        assert HashCheck(scheme, seed).verdict([(hashes, tokens, 16)]) == (True, "")
    made_up = sarp.as_hashes([1, 2, 3, 4])
    ok, note = HashCheck("vllm-sha256").verdict([(made_up, tokens, 16)])
    assert not ok and note.startswith("no known scheme")
    assert HashCheck("vllm-sha256").verdict([]) is None
