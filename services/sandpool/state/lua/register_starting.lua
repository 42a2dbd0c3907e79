-- Register a sandbox about to be created, unless its pool is at its ceiling.
-- KEYS[1] sandbox hash, KEYS[2] pool members set
-- ARGV: sandbox_id, ceiling, pool, image, created_at, owner, record_ttl_ms
-- -> 1 registered (state=starting), 0 the pool is at its ceiling.
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'starting', 'pool', ARGV[3], 'image', ARGV[4],
           'created_at', ARGV[5], 'owner', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
