"""The Lua scripts of the Valkey backend (:mod:`sarp.store_valkey`), each one atomic on
the namespace's one node.  Every script that writes first checks that the lease still
holds this writer's value, so that a writer paused past its lease can never write, but
:data:`LOG`, which only runs inside a transaction the lease fences.
"""

from __future__ import annotations

import hashlib

from . import resp

# A batch's commit is not a script: its table changes go as plain HSET/HDEL commands in
# one MULTI/EXEC, fenced by a WATCH of the lease (sarp.store_valkey.ValkeyStore.transact),
# because a script's arguments each become a Lua string and back (measured: 0.6 us per
# argument, five times what the HSET itself costs).  Only the log entries, one XADD each,
# go through this script inside that transaction (one command instead of thousands).
# KEYS: log.  ARGV: trim MINID ("" for none), the first entry's sequence, and the
# entries' values end to end (12 bytes each: LOG_VALUE), their sequences consecutive.
LOG = """
local first, values = tonumber(ARGV[2]), ARGV[3]
for k = 0, #values / 12 - 1 do
  redis.call('XADD', KEYS[1], string.format('%d-1', first + k), 'v',
             string.sub(values, 12 * k + 1, 12 * k + 12))
end
if ARGV[1] ~= '' then redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1]) end
return 1
"""


# KEYS: lease, the key to set.  ARGV: lease value, its new value.
SET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('SARPFENCED this writer no longer holds the lease')
end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""


# KEYS: meta seg.  ARGV: segment ids.  The counters and the records, in one atomic read.
READ = """
local values = {}
for j = 1, #ARGV, 500 do
  local got = redis.call('HMGET', KEYS[2], unpack(ARGV, j, math.min(#ARGV, j + 499)))
  for k = 1, #got do values[#values + 1] = got[k] end
end
return {redis.call('HGETALL', KEYS[1]), values}
"""


# KEYS: lease.  ARGV: lease value, milliseconds (0: release).
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) == 0 then redis.call('DEL', KEYS[1]) else
  redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


class ReadAhead:
    """A reader's ``READ`` commands (the segment keys packed with one ``join``:
    :class:`sarp.resp.Keys8`), and the one sent ahead of its match whose reply is not
    read yet (:meth:`sarp.store_valkey.ValkeyStore.read_ahead`).

    >>> r = ReadAhead(b"m", b"s")
    >>> r.command([b"12345678"]).endswith(b"$1\\r\\nm\\r\\n$1\\r\\ns\\r\\n$8\\r\\n12345678\\r\\n")
    True
    """

    __slots__ = ("head", "pending", "fields", "reply")

    def __init__(self, meta_key: bytes, seg_key: bytes) -> None:
        sha = hashlib.sha1(READ.encode()).hexdigest().encode()  # as EVALSHA names it
        self.head = resp.command(b"EVALSHA", sha, 2, meta_key, seg_key).split(b"\r\n", 1)[1]
        self.pending: bytes | None = None  # sent, its reply not read
        self.fields: list[bytes] = []  # the segment keys it asks for
        self.reply: list | None = None  # its reply, when C read it (adopt_reply)

    def command(self, fields: list[bytes]) -> bytes:
        """``READ`` of these segment keys: the fixed arguments packed once."""
        keys = resp.Keys8(fields)
        return b"*%d\r\n%s%s" % (5 + keys.count, self.head, keys.data)

    def command_for(self, fields: list[bytes]) -> bytes:
        """The command of these keys: the pending one's very bytes when it asks for them."""
        if self.pending is not None and (fields is self.fields or fields == self.fields):
            return self.pending
        return self.command(fields)
