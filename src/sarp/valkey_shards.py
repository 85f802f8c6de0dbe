"""The shards of a sharded index on Valkey (:func:`sarp.open` with ``shard=``): their
registry, ``sarp:{NS}:shards`` (shard name -> its own namespace), and where a new
shard's namespace goes, so that the shards spread over a cluster's nodes.  It calls the
clients :func:`sarp.store_valkey.connect` makes and imports no client itself.
"""

from __future__ import annotations

from .errors import NotAnIndexError, StoreError
from .store import check_shard_name, parse_url
from .store_valkey import UNREACHABLE, connect


def _registry(settings: dict) -> bytes:
    return f"sarp:{{{settings['namespace']}}}:shards".encode()


def _with_namespace(url: str, namespace: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + namespace


class ShardRegistry:
    """The shards registered under a URL's namespace, read on one kept connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.settings = parse_url(url)
        try:
            self._client = connect(self.settings)
        except UNREACHABLE as exc:
            raise StoreError(f"{url}: cannot reach Valkey ({exc}); is the server up?") from exc

    def shards(self) -> dict[str, str]:
        """Name -> the URL of each shard's own namespace.  Cost: one ``HGETALL``."""
        try:
            got = self._client.hgetall(_registry(self.settings))
        except UNREACHABLE as exc:
            raise StoreError(f"{self.url}: cannot reach Valkey ({exc}); is the server "
                             "up?") from exc
        return {name.decode(): _with_namespace(self.url, ns.decode())
                for name, ns in sorted(got.items())}

    def close(self) -> None:
        self._client.close()


def shard_url(url: str, shard: str, *, create: bool = True) -> str:
    """The URL of shard ``shard`` of the sharded index at ``url``: a namespace of its
    own, registered under ``url``'s (``sarp:{NS}:shards``).  A new one, on a cluster,
    gets a namespace whose slot is on the node holding the fewest shards, so that the
    shards spread over the nodes (and their writers' and readers' traffic with them).

    Cost: a connection, one ``HGET``; a new shard a few more (``HSETNX``: two writers
    naming one new shard at once get the same namespace).
    """
    check_shard_name(shard)
    settings = parse_url(url)
    base = f"{settings['namespace']}:shard:{shard}"
    if len(base) + 5 > 64:
        raise ValueError(f"{url!r} with shard {shard!r}: namespace and shard name together "
                         "must stay within 59 characters; shorten one")
    client = connect(settings)
    try:
        key = _registry(settings)
        known = client.hget(key, shard)
        if known is None and not create:
            raise NotAnIndexError(f"{url}: no shard {shard!r} is registered; open it once "
                                  "without readonly=True to create it")
        if known is None:
            client.hsetnx(key, shard, _placed(client, base, client.hvals(key)))
            known = client.hget(key, shard)
    except UNREACHABLE as exc:
        raise StoreError(f"{url}: cannot reach Valkey ({exc}); is the server up?") from exc
    finally:
        client.close()
    return _with_namespace(url, known.decode())


def _placed(client, base: str, registered: list[bytes]) -> str:
    """``base`` with a suffix whose slot is on the node with the fewest of the
    ``registered`` shards (off a cluster, the one server: suffix 0)."""
    if not hasattr(client, "get_node_from_key"):
        return f"{base}:0"

    def node(ns: str):
        return client.get_node_from_key(f"sarp:{{{ns}}}:meta").name

    load = {n.name: 0 for n in client.get_primaries()}
    for ns in registered:
        where = node(ns.decode())
        load[where] = load.get(where, 0) + 1
    target = min(load, key=lambda n: (load[n], n))
    for k in range(10_000):  # 16,384 slots over a few nodes: a handful of tries
        if node(f"{base}:{k}") == target:
            return f"{base}:{k}"
    return f"{base}:0"


def drop_namespace(url: str) -> int:
    """Delete every key of the index at ``url`` (``sarp:{NS}:*``, its shard registry
    too; not the shards' own namespaces): how many.  For benchmarks, so that each pass
    starts on a server as the first pass found it (as each LMDB pass starts in a new
    folder); there is no undo.  Cost: a ``SCAN`` of the namespace's node, a ``DEL``
    per 1,000 keys.

    >>> import sarp
    >>> from sarp.bench.valkey_server import ValkeyServer
    >>> with ValkeyServer() as server:
    ...     with sarp.open(server.url("gone")) as index:
    ...         _ = index.insert([1, 2], holder="w0")
    ...     drop_namespace(server.url("gone")) > 0, drop_namespace(server.url("gone"))
    (True, 0)
    """
    settings = parse_url(url)
    try:
        client = connect(settings)
    except UNREACHABLE as exc:
        raise StoreError(f"{url}: cannot reach Valkey ({exc}); is the server up?") from exc
    try:
        prefix = f"sarp:{{{settings['namespace']}}}:"
        node = client
        if hasattr(client, "get_node_from_key"):  # a cluster: the namespace is one slot
            node = client.get_valkey_connection(client.get_node_from_key(prefix + "meta"))
        # (a namespace holds no glob character: store.NAMESPACE)
        keys = list(node.scan_iter(match=prefix + "*", count=1000))
        for i in range(0, len(keys), 1000):
            node.delete(*keys[i:i + 1000])
        return len(keys)
    finally:
        client.close()
