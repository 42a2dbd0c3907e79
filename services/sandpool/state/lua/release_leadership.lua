-- Compare-and-delete of the leader key.
-- KEYS[1] leader key
-- ARGV[1] {replica}
-- Returns 1 released, 0 not ours.
local a = cjson.decode(ARGV[1])
if redis.call('GET', KEYS[1]) == a.replica then
  return redis.call('DEL', KEYS[1])
end
return 0
