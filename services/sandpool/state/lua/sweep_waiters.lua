-- uses: waiting
-- Forget waiters whose api replica vanished (their hash expired) and hand on what was promised to them.
-- KEYS[1] pool waiters set   KEYS[2] pool queued set   KEYS[3] pool wait ring   KEYS[4] pool ready list
-- KEYS[5] pool members set
-- ARGV[1] {waiter_prefix, sandbox_prefix, queue_prefix (the pool's wait queues), promised (channel),
--         cursor (where this sweep's look at the members goes on: '0' to begin), count (members looked at)}
-- Returns {how many waiters were forgotten plus how many promised sandboxes were handed on, the next
-- cursor ('0': the members have all been looked at)}. The members are looked at `count` per call (an
-- SSCAN step), not all at once: at 100,000 sandboxes that one call held Redis for a second.
local a = cjson.decode(ARGV[1])
local fixed = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', a.waiter_prefix .. id) == 0 then
    redis.call('SREM', KEYS[1], id)
    redis.call('SREM', KEYS[2], id)
    fixed = fixed + 1
  end
end
local step = redis.call('SSCAN', KEYS[5], a.cursor, 'COUNT', a.count)
for _, sandbox in ipairs(step[2]) do
  local key = a.sandbox_prefix .. sandbox
  local f = redis.call('HMGET', key, 'state', 'promised_to')
  if f[1] == 'promised' and (not f[2] or redis.call('HGET', a.waiter_prefix .. f[2], 'sandbox') ~= sandbox) then
    hand_on(sandbox, key, KEYS[4], true, KEYS[3], a.queue_prefix, a.waiter_prefix, KEYS[2], a.promised)
    fixed = fixed + 1
  end
end
return {fixed, step[1]}
