"""The Lua scripts of the Valkey backend (:mod:`sarp.store_valkey`), each one atomic on
the namespace's one node.  Every script that writes first checks that the lease still
holds this writer's value, so that a writer paused past its lease can never write.
"""

from __future__ import annotations

# KEYS: lease meta seg blk hold alias log.  ARGV: lease value, trim MINID ("" for none),
# then per table (meta, seg, blk, hold, alias): n, n field/value pairs, m, m fields to delete; then
# k, k (stream id, value) pairs.  Chunks keep unpack() under Lua's stack limit (8,000).
COMMIT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('SARPFENCED this writer no longer holds the lease')
end
local i = 3
for t = 2, 6 do
  local n = tonumber(ARGV[i]); i = i + 1
  for j = 0, n - 1, 2000 do  -- the pairs lie in ARGV in order: unpack a range of them
    redis.call('HSET', KEYS[t], unpack(ARGV, i + 2 * j, i + 2 * math.min(n, j + 2000) - 1))
  end
  i = i + 2 * n
  n = tonumber(ARGV[i]); i = i + 1
  for j = 0, n - 1, 4000 do
    redis.call('HDEL', KEYS[t], unpack(ARGV, i + j, i + math.min(n, j + 4000) - 1))
  end
  i = i + n
end
local n = tonumber(ARGV[i]); i = i + 1
for k = 0, n - 1 do
  redis.call('XADD', KEYS[7], ARGV[i + 2 * k], 'v', ARGV[i + 2 * k + 1])
end
if ARGV[2] ~= '' then redis.call('XTRIM', KEYS[7], 'MINID', ARGV[2]) end
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
