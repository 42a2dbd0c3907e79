-- Register a sandbox about to be created, unless its pool is at its ceiling.
-- KEYS[1] sandbox hash   KEYS[2] pool members set   KEYS[3] pool starting set
-- ARGV[1] {sandbox, ceiling, pool, image, created_at, owner, record_ttl_ms}
-- Returns 1 registered (state=starting), 0 the pool is at its ceiling.
local a = cjson.decode(ARGV[1])
if redis.call('SCARD', KEYS[2]) >= a.ceiling then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'starting', 'pool', a.pool, 'image', a.image,
           'created_at', a.created_at, 'owner', a.owner)
redis.call('PEXPIRE', KEYS[1], a.record_ttl_ms)
redis.call('SADD', KEYS[2], a.sandbox)
redis.call('SADD', KEYS[3], a.sandbox)
return 1
