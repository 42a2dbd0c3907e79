-- Drop every trace of a sandbox the provider no longer runs.
-- KEYS[1] sandbox hash   KEYS[2] pool members set   KEYS[3] pool ready list   KEYS[4] doomed set
-- KEYS[5] pool leased set   KEYS[6] pool starting set
-- ARGV[1] {sandbox}
-- Returns 1.
local a = cjson.decode(ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], a.sandbox)
redis.call('LREM', KEYS[3], 0, a.sandbox)
redis.call('SREM', KEYS[4], a.sandbox)
redis.call('SREM', KEYS[5], a.sandbox)
redis.call('SREM', KEYS[6], a.sandbox)
return 1
