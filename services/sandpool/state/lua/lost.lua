-- The provider says a sandbox died on its own: nobody may lease it any more. A ready one leaves the
-- ready list now (atomically with leases), a promised one's waiter is queued again; either is doomed.
-- (A leased one's session is released by the release script: its reason is `dead`.)
-- KEYS[1] sandbox hash   KEYS[2] pool ready list   KEYS[3] doomed set   KEYS[4] pool queued set
-- KEYS[5] pool wait ring
-- ARGV[1] {sandbox, waiter_prefix, queue_prefix (the pool's wait queues), nudge (channel)}
-- Returns {state before, session ('' when none)}.
local a = cjson.decode(ARGV[1])
local f = redis.call('HMGET', KEYS[1], 'state', 'session', 'promised_to')
local state = f[1] or ''
if state == 'ready' or state == 'starting' then
  redis.call('LREM', KEYS[2], 0, a.sandbox)
elseif state == 'promised' and f[3] then
  local waiter = a.waiter_prefix .. f[3]
  local w = redis.call('HMGET', waiter, 'state', 'workspace')
  if w[1] == 'promised' then
    redis.call('HSET', waiter, 'state', 'queued', 'sandbox', '')
    redis.call('SADD', KEYS[4], f[3])
    if redis.call('LPUSH', a.queue_prefix .. w[2], f[3]) == 1 then redis.call('LPUSH', KEYS[5], w[2]) end
  end
end
if state ~= '' and state ~= 'leased' and state ~= 'doomed' then
  redis.call('HSET', KEYS[1], 'state', 'doomed')
  redis.call('SADD', KEYS[3], a.sandbox)
end
redis.call('PUBLISH', a.nudge, a.sandbox)
return {state, f[2] or ''}
