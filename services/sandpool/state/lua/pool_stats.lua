-- Count a pool's sandboxes by state (read only; bounded by the pool's ceiling).
-- KEYS[1] pool members set
-- ARGV[1] {sandbox_prefix}
-- Returns {starting, ready, leased, doomed}.
-- (A sandbox promised to a waiter counts as leased: it is taken.)
local a = cjson.decode(ARGV[1])
local counts = {starting = 0, ready = 0, leased = 0, doomed = 0}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local state = redis.call('HGET', a.sandbox_prefix .. id, 'state')
  if state == 'promised' then state = 'leased' end
  if state and counts[state] then counts[state] = counts[state] + 1 end
end
return {counts.starting, counts.ready, counts.leased, counts.doomed}
