"""Fenced writes on Valkey: one Lua script against WATCH + GET + MULTI/EXEC.

    .venv/bin/python benchmarks/valkey_write.py

A write of N 200-byte fields to a hash, fenced by a lease check: the script checks
the lease and writes in one step (what sarp's ValkeyStore does); the transaction
WATCHes the lease, GETs it, checks it client-side and runs MULTI/HSET/EXEC.  Rounds
of 500 writes, the two alternated 5 times, medians (docs/design.md quotes them).
"""

from __future__ import annotations

import statistics
import time
import uuid

import valkey

from sarp.bench.valkey_server import ValkeyServer

SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('FENCED') end
redis.call('HSET', KEYS[2], unpack(ARGV, 2))
return 1
"""


def main() -> None:
    with ValkeyServer() as server:
        c = valkey.Valkey(port=server.port)
        lease = b"1:" + uuid.uuid4().hex.encode()
        c.set("lease", lease)
        script = c.register_script(SCRIPT)

        def by_script(fields: list[tuple[bytes, bytes]]) -> None:
            args: list = [lease]
            for k, v in fields:
                args += (k, v)
            script(keys=["lease", "h"], args=args)

        def by_multi(fields: list[tuple[bytes, bytes]]) -> None:
            with c.pipeline(transaction=True) as p:
                p.watch("lease")
                if p.get("lease") != lease:
                    raise RuntimeError("fenced")
                p.multi()
                p.hset("h", mapping=dict(fields))
                p.execute()

        times: dict[tuple[int, str], list[float]] = {}
        for n in (3, 30, 300):
            fields = [(f"k{i}".encode(), b"v" * 200) for i in range(n)]
            for name, fn in (("script", by_script), ("multi", by_multi)) * 5:
                t0 = time.perf_counter()
                for _ in range(500):
                    fn(fields)
                times.setdefault((n, name), []).append((time.perf_counter() - t0) / 500 * 1e6)
        for (n, name), v in sorted(times.items()):
            print(f"{n:4d} fields {name:7s} median {statistics.median(v):7.1f} us "
                  f"(min {min(v):.1f}, max {max(v):.1f})")


if __name__ == "__main__":
    main()
