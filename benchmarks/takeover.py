"""How long a standby takes to take over an index on Valkey from a writer killed with
SIGKILL (the latency the lease test in tests/test_valkey.py no longer bounds).

    .venv/bin/python benchmarks/takeover.py --rounds 5 --lease-s 2

Each round: a writer process opens the index and acknowledges 20 inserts; it is
killed; a standby opens with ``wait_for_lease_s`` and the time from the kill to its
open returning is taken; every acknowledged insert is then checked.  Prints the median
and spread; the expected figure is about the lease (the lease has to run out).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
import uuid

import sarp
from sarp.bench.valkey_server import ValkeyServer

WRITER = """
import json, sys, sarp
index = sarp.open(sys.argv[1], durability="sync", lease_s=float(sys.argv[2]))
for k in range(1, 21):
    index.insert([10_000 * k + i for i in range(1, 6)], holder=f"w{k}")
print(json.dumps("acked"), flush=True)
sys.stdin.read()
"""


def one_round(server: ValkeyServer, lease_s: float) -> float:
    url = server.url(f"takeover-{uuid.uuid4().hex[:8]}")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url, str(lease_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline()) == "acked"
    proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    proc.wait(timeout=10)
    with sarp.open(url, durability="nosync", lease_s=lease_s,
                   wait_for_lease_s=10 * lease_s + 10) as index:
        took = time.monotonic() - killed
        for k in range(1, 21):
            assert index.match([10_000 * k + i for i in range(1, 6)]).by_holder == {f"w{k}": 5}
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lease-s", type=float, default=2.0)
    args = parser.parse_args()
    server = ValkeyServer()
    try:
        took = [one_round(server, args.lease_s) for _ in range(args.rounds)]
    finally:
        server.stop()
    print(f"takeover after SIGKILL, lease {args.lease_s} s: median {statistics.median(took):.2f} s "
          f"(min {min(took):.2f}, max {max(took):.2f}, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
