"""The operator's files in ``deploy/``: the alert rules pass ``promtool check rules``;
every metric the dashboard, the rules and docs/operating.md name is one a live serve
exports; the Kubernetes manifests validate against the API's schemas; the systemd
unit verifies; the container file installs the wheel ``make wheel`` names."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
import zmq
from servekit import Serve, call

from sarp.bench import conformance as cf

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
METRIC = re.compile(r"\bsarp_[a-z_]+\b")
SARP = [sys.executable, "-m", "sarp.cli"]
REQUIRED = os.environ.get("SARP_REQUIRE_TOOLS") == "1"  # .ci/run: a missing tool fails


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if REQUIRED:
            pytest.fail(f"{name} is not installed (.ci/run installs it: Debian's package)")
        pytest.skip(f"{name} is not installed (Debian: apt-get install prometheus / systemd)")
    return path


def test_the_alert_rules_pass_promtool(tmp_path):
    promtool = _tool("promtool")
    rules = DEPLOY / "prometheus/sarp-alerts.yml"
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS: 9 rules found" in out.stdout, out.stdout + out.stderr
    broken = tmp_path / "broken.yml"  # and promtool does refuse a broken expression
    broken.write_text(rules.read_text().replace("max by (instance) (sarp_ready) == 0",
                                                "max by (instance) (sarp_ready == 0", 1))
    assert subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True,
                          timeout=60).returncode != 0


def _exported(port: int) -> set[str]:
    """Every sample name a live /metrics has, or will have once it counts: a counter
    family with no sample yet is listed by its TYPE line."""
    _, text = call(port, "GET", "/metrics")
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("", "_bucket", "_sum", "_count"),
                "gauge": ("",)}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {name.removesuffix("_total") + s for s in suffixes.get(kind, ("",))}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _named() -> dict[str, set[str]]:
    dashboard = json.loads((DEPLOY / "grafana/sarp-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((DEPLOY / "prometheus/sarp-alerts.yml").read_text())
    alerts = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return {"dashboard": {m for e in exprs for m in METRIC.findall(e)},
            "alerts": {m for e in alerts for m in METRIC.findall(e)},
            "docs/operating.md": set(METRIC.findall((ROOT / "docs/operating.md").read_text()))}


def test_the_dashboard_rules_and_guide_name_only_metrics_serve_exports(tmp_path):
    context = zmq.Context()
    pub = cf.Publisher(context, name="e1")
    engine = cf.Engine(1, 0, "llama", "vllm-0.33", pub)
    try:
        with Serve(tmp_path / "ix", [], "--http-idle-timeout-s", "0.5") as serve:
            serve.wait_ready()
            body = {"instance_id": 1, "endpoint": pub.endpoint,
                    "replay_endpoint": pub.replay_endpoint, "model_name": "llama",
                    "block_size": cf.BLOCK_SIZE}
            assert call(serve.port, "POST", "/register", json.dumps(body).encode())[0] == 201
            engine.serve(np.arange(1, 5, dtype=np.uint64))
            assert call(serve.port, "POST", "/v1/match", b'{"block_hashes": [1, 2]}')[0] == 200
            assert call(serve.port, "POST", "/v1/match", b'{"block_hashes": "x"}')[0] == 400
            with socket.create_connection(("127.0.0.1", serve.port)) as idle:
                idle.settimeout(5)
                assert idle.recv(1) == b""  # closed for idling: counted by reason
            serve.wait_for(lambda: "sarp_source_events_total" in _exported(serve.port),
                           what="the engine's counters")
            exported = _exported(serve.port)
    finally:
        pub.close()
        context.term()
    for where, names in _named().items():
        assert names, where
        assert names <= exported, (where, sorted(names - exported))
    # the dashboard graphs every family serve exports
    assert {n for n in exported if n.startswith("sarp_")} - _named()["dashboard"] == {
        "sarp_match_seconds", "sarp_match_seconds_sum", "sarp_match_seconds_count"}


def test_the_kubernetes_manifests_validate_and_name_what_serve_takes(tmp_path):
    from kubernetes_validate import validate
    from kubernetes_validate.utils import ValidationError

    from sarp.serving.sources import read_sources_file

    docs = [d for f in sorted((DEPLOY / "k8s").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text())]
    for doc in docs:
        validate(doc, "1.30.0", strict=True)
    bad = json.loads(json.dumps(docs[-1]))
    bad["spec"]["bogus"] = 1
    with pytest.raises(ValidationError):
        validate(bad, "1.30.0", strict=True)
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Deployment"):
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            args = container["args"]
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            # serve takes the arguments (checked as far as --help), with the pod's files
            # (its volume, the secret, the ConfigMap) here
            (tmp_path / "token").write_text("s3cret\n")
            (tmp_path / "engines.yaml").write_text("[]\n")
            here = [a.replace("/etc/sarp/token", str(tmp_path / "token"))
                     .replace("/etc/sarp/engines/engines.yaml", str(tmp_path / "engines.yaml"))
                     .replace("/var/lib/sarp", str(tmp_path)) for a in args]
            out = subprocess.run([*SARP, "serve", *here, "--help"], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
        if doc["kind"] == "ConfigMap":
            listed = tmp_path / "engines.yaml"
            listed.write_text(doc["data"]["engines.yaml"])
            assert [s.key for s in read_sources_file(str(listed))] == ["1"]


def test_the_systemd_unit_verifies(tmp_path):
    analyze = _tool("systemd-analyze")
    unit = (DEPLOY / "systemd/sarp.service").read_text()
    assert "ExecStart=/usr/local/bin/sarp serve --index /var/lib/sarp/kv-index" in unit
    local = tmp_path / "sarp.service"  # the sarp this test runs, where the unit has its own
    local.write_text(unit.replace("/usr/local/bin/sarp", str(Path(sys.executable).parent / "sarp")))
    out = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "sarp.service" not in out.stderr, out.stderr
    local.write_text(local.read_text().replace("Restart=always", "Restart=sometimes"))
    out = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True,
                         timeout=60)
    assert "restart specifier" in out.stderr  # and it does find a bad value


def test_the_container_file_installs_the_wheel_and_runs_serve():
    lines = [ln for ln in (DEPLOY / "Dockerfile").read_text().splitlines()
             if ln and not ln.startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"  # the wheel's cp311 tag
    copy = next(ln for ln in lines if ln.startswith("COPY "))
    assert copy.split()[1] == "dist/sarp-*manylinux*.whl"  # what `make wheel` leaves
    assert 'ENTRYPOINT ["sarp", "serve"]' in lines
    cmd = json.loads(next(ln for ln in lines if ln.startswith("CMD "))[4:])
    out = subprocess.run([*SARP, "serve", *cmd, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert any(ln.startswith("HEALTHCHECK") and "/healthz" in ln for ln in lines)
