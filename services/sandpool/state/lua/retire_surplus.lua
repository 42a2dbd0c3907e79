-- Doom ready sandboxes above the target. Atomic with the lease script.
-- KEYS[1] pool ready list   KEYS[2] doomed set
-- ARGV[1] {sandbox_prefix, how_many}
-- Returns how many ready sandboxes were doomed. The newest go (leases take the oldest); a listed id
-- that is no longer `ready` is only dropped from the list.
local a = cjson.decode(ARGV[1])
local retired = 0
for _ = 1, a.how_many do
  local id = redis.call('RPOP', KEYS[1])
  if not id then break end
  local key = a.sandbox_prefix .. id
  if redis.call('HGET', key, 'state') == 'ready' then
    redis.call('HSET', key, 'state', 'doomed')
    redis.call('SADD', KEYS[2], id)
    retired = retired + 1
  end
end
return retired
