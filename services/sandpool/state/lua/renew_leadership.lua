-- Compare-and-renew of the leader key.
-- KEYS[1] leader key
-- ARGV[1] {replica, leadership_ms}
-- Returns 1 still ours (renewed), 0 lost.
local a = cjson.decode(ARGV[1])
if redis.call('GET', KEYS[1]) == a.replica then
  redis.call('PEXPIRE', KEYS[1], a.leadership_ms)
  return 1
end
return 0
