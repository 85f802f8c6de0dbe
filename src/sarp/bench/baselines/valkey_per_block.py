"""valkey-per-block: one Valkey hash per block, its fields the holders that have it.

The way llm-d's Redis index keys blocks: ``HSET <block> <holder> ...`` on store,
``HDEL`` on eviction, and a lookup that pipelines one ``HKEYS`` per block of the
request (one round trip) and counts the leading blocks some holder has.
"""

from __future__ import annotations

from ...store import parse_url
from ...store_valkey import connect
from ._common import BaselineMatch, keys_of


def open(url: str, durability: str = "sync", **_: object) -> ValkeyPerBlockIndex:  # noqa: A001
    """``url``: ``valkey://HOST:PORT/NAMESPACE``; every key starts ``vpb:NAMESPACE:``."""
    return ValkeyPerBlockIndex(url)


class ValkeyPerBlockIndex:
    def __init__(self, url: str) -> None:
        settings = parse_url(url)
        self.client = connect(settings)
        self.prefix = f"vpb:{settings['namespace']}:".encode()

    def _keys(self, hashes) -> list[bytes]:
        return [self.prefix + k for k in keys_of(hashes)]

    def insert(self, hashes, parent=None, *, holder: str, medium: str = "GPU") -> int:
        field = f"{holder}|{medium}".encode()
        pipe = self.client.pipeline(transaction=False)
        for key in self._keys(hashes):
            pipe.hset(key, field, b"1")
        return sum(pipe.execute())

    def remove(self, hashes, *, holder: str, medium: str = "GPU") -> int:
        field = f"{holder}|{medium}".encode()
        pipe = self.client.pipeline(transaction=False)
        for key in self._keys(hashes):
            pipe.hdel(key, field)
        return sum(pipe.execute())

    def clear(self, holder: str, medium: str | None = None) -> int:
        removed = 0
        for key in self.client.scan_iter(match=self.prefix + b"*", count=1000):
            fields = [f for f in self.client.hkeys(key)
                      if f.startswith(f"{holder}|".encode())
                      and (medium is None or f == f"{holder}|{medium}".encode())]
            if fields:
                removed += self.client.hdel(key, *fields)
        return removed

    def match(self, hashes) -> BaselineMatch:
        keys = self._keys(hashes)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hkeys(key)
        n = 0
        for holders in pipe.execute():
            if not holders:
                break
            n += 1
        return BaselineMatch(n, storage_reads=len(keys))

    def close(self) -> None:
        self.client.close()

    def stats(self) -> dict[str, int]:
        return {"memory_bytes": 0, "disk_bytes": 0}
