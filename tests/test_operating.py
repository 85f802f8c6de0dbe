"""docs/operating.md as an operator runs it: its ``bash`` blocks, in order, in a shell,
against a simulated engine that publishes what vLLM publishes (real vLLM hashes of its
tokens, vLLM 0.33's encoding) on the ports the guide names, swapped for free loopback
ports; ``/var/lib/sarp`` is a temporary folder.  Each command exits 0 and says what
the guide says it says; the ``sh`` blocks (engine launch lines) name the same ports
and block size as the commands that are run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq
from servekit import call, free_port, wait_until

import sarp
from sarp.bench import conformance as cf

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs/operating.md").read_text()


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", GUIDE, flags=re.S)


def test_the_engine_lines_and_the_commands_name_the_same_ports_and_block_size():
    engines, commands = _blocks("sh"), "\n".join(_blocks("bash"))
    for line in engines[:2]:  # vLLM's and SGLang's launch lines
        config = json.loads(re.search(r"--kv-events-config '(\{.*?\})'", line).group(1))
        assert config["endpoint"] == "tcp://*:5557"
        assert config["replay_endpoint"] == "tcp://*:5558"
        assert re.search(r"--(block|page)-size 16\b", line)
    register = json.loads(re.search(r"/register -d '(\{.*?\})'", commands).group(1))
    assert register["endpoint"].endswith(":5557")
    assert register["replay_endpoint"].endswith(":5558")
    assert register["block_size"] == 16


def test_the_guides_commands_run_against_a_simulated_engine(tmp_path):
    context = zmq.Context()
    pub = cf.Publisher(context, name="vllm")
    pub_port, replay_port = (int(e.rsplit(":", 1)[1])
                             for e in (pub.endpoint, pub.replay_endpoint))
    http_port = free_port()
    swaps = {"127.0.0.1:8080": f"127.0.0.1:{http_port}",
             "10.0.0.5:5557": f"127.0.0.1:{pub_port}",
             "10.0.0.5:5558": f"127.0.0.1:{replay_port}",
             "/var/lib/sarp": str(tmp_path / "var-lib-sarp")}
    (tmp_path / "var-lib-sarp").mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    lines = [ln for block in _blocks("bash") for ln in block.strip().splitlines()]
    assert len(lines) == 7, lines
    background: list[subprocess.Popen] = []
    outputs: dict[str, str] = {}
    tokens = list(range(101, 134))  # the guide's query: 33 tokens, two full blocks
    try:
        for line in lines:
            for old, new in swaps.items():
                line = line.replace(old, new)
            if line.endswith("&"):
                log = (tmp_path / "serve.log").open("w")
                background.append(subprocess.Popen("exec " + line[:-1], shell=True, env=env,
                                                   stdout=log, stderr=log))
                _wait(lambda: call(http_port, "GET", "/healthz", timeout_s=2)[0] == 200,
                      tmp_path)
                continue
            if "/readyz" in line or "/query" in line:
                _wait(lambda: call(http_port, "GET", "/readyz", timeout_s=2)[0] == 200,
                      tmp_path)
            if "/query" in line:
                _wait(lambda: '"1"' in _post_query(http_port, tokens), tmp_path)
            if "/workers" in line:  # the writer's status, written twice a second
                _wait(lambda: call(http_port, "GET", "/workers", timeout_s=2)[1], tmp_path)
            out = subprocess.run(line, shell=True, env=env, capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, (line, out.stderr)
            outputs[line.split()[0] + " " + line.split()[-1][:40]] = out.stdout
            if "/register" in line:  # the engine stores the guide's prompt once followed
                assert json.loads(out.stdout) == {"status": "ok", "instance_id": 1,
                                                  "dp_rank": 0}
                pub.wait_subscribers(1)
                hashes = sarp.hash_blocks(tokens, 16, scheme="vllm-sha256").tolist()
                pub.publish(msgpack.packb([time.time(), [{
                    "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                    "token_ids": tokens[:32], "block_size": 16, "medium": "GPU",
                    "lora_name": None}], 0]))
            if "/workers" in line:
                assert [w["instance_id"] for w in json.loads(out.stdout)] == [1]
            if "/readyz" in line:
                assert json.loads(out.stdout)["ready"] is True
            if "/query" in line:
                got = json.loads(out.stdout)
                assert got["scores"] == {"1": {"0": 32}}  # as the guide shows
                assert got["instances"]["1"]["gpu"] == 32
            if line.startswith("sarp stats"):
                stats = json.loads(out.stdout)
                assert stats["blocks"] == 2 and stats["serve"]["caught_up"] is True
            if "/metrics" in line:
                assert out.stdout.strip() == "sarp_ready 1.0"
        assert len(outputs) == 6
    finally:
        for proc in background:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        pub.close()
        context.term()
    assert background[0].returncode == 0


def _post_query(port: int, tokens: list[int]) -> str:
    status, body = call(port, "POST", "/query", json.dumps(
        {"token_ids": tokens, "model_name": "llama-3.1-8b"}).encode(), timeout_s=5)
    return json.dumps(body) if status == 200 else ""


def _wait(done, tmp_path: Path, timeout_s: float = 60.0) -> None:
    wait_until(done, timeout_s, lambda: (tmp_path / "serve.log").read_text()[-3000:])
