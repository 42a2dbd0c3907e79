-- Doom ready sandboxes above the target. Atomic with the lease script.
-- KEYS[1] pool ready list, KEYS[2] doomed set
-- ARGV: sandbox key prefix, how many
-- -> how many ready sandboxes were doomed. The newest go (leases take the oldest); a listed id
--    that is no longer `ready` is only dropped from the list.
local retired = 0
for _ = 1, tonumber(ARGV[2]) do
  local id = redis.call('RPOP', KEYS[1])
  if not id then break end
  local key = ARGV[1] .. id
  if redis.call('HGET', key, 'state') == 'ready' then
    redis.call('HSET', key, 'state', 'doomed')
    redis.call('SADD', KEYS[2], id)
    retired = retired + 1
  end
end
return retired
