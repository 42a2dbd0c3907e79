-- Drop every trace of a sandbox the provider no longer runs.
-- KEYS[1] sandbox hash, KEYS[2] pool members set, KEYS[3] pool ready list, KEYS[4] doomed set,
-- KEYS[5] pool leased set
-- ARGV: sandbox_id
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('LREM', KEYS[3], 0, ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
return 1
