-- uses: waiting
-- Forget waiters whose api replica vanished (their hash expired) and hand on what was promised to them.
-- KEYS[1] pool waiters set, KEYS[2] pool queued set, KEYS[3] pool wait ring, KEYS[4] pool ready list,
-- KEYS[5] pool members set
-- ARGV: waiter prefix, sandbox prefix, wait queue prefix, promised channel
-- -> how many waiters were forgotten plus how many promised sandboxes were handed on.
local fixed = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then
    redis.call('SREM', KEYS[1], id)
    redis.call('SREM', KEYS[2], id)
    fixed = fixed + 1
  end
end
for _, sandbox in ipairs(redis.call('SMEMBERS', KEYS[5])) do
  local key = ARGV[2] .. sandbox
  local f = redis.call('HMGET', key, 'state', 'promised_to')
  if f[1] == 'promised' and (not f[2] or redis.call('HGET', ARGV[1] .. f[2], 'sandbox') ~= sandbox) then
    hand_on(sandbox, key, KEYS[4], true, KEYS[3], ARGV[3], ARGV[1], KEYS[2], ARGV[4])
    fixed = fixed + 1
  end
end
return fixed
