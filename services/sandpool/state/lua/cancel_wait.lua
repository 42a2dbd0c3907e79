-- uses: meter waiting
-- A waiter stops waiting (its wait ended, or its client left): it leaves the queue, and a sandbox
-- promised to it goes to the next waiter or back to the ready list (it was never leased).
-- KEYS[1] the waiter's hash      KEYS[2] pool waiters set          KEYS[3] pool queued set
-- KEYS[4] pool wait ring         KEYS[5] the workspace's wait queue in the pool
-- KEYS[6] workspace waiters set  KEYS[7] pool ready list
-- KEYS[8] usage total hash       KEYS[9] usage day hash    KEYS[10] usage workspaces set
-- KEYS[11] usage event stream
-- ARGV[1] {waiter, workspace, pool, now, refusal (the wait ran out: meter a capacity refusal with this
--          limit; '' for none), retention,
--          maxlen, sandbox_prefix, queue_prefix, waiter_prefix, promised (channel)}, JSON
-- Returns 1.
local a = cjson.decode(ARGV[1])
local f = redis.call('HMGET', KEYS[1], 'state', 'sandbox')
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], a.waiter)
redis.call('SREM', KEYS[3], a.waiter)
redis.call('SREM', KEYS[6], a.waiter)
redis.call('LREM', KEYS[5], 0, a.waiter)
if redis.call('LLEN', KEYS[5]) == 0 then redis.call('LREM', KEYS[4], 0, a.workspace) end
if f[1] == 'promised' and f[2] and f[2] ~= '' then
  local key = a.sandbox_prefix .. f[2]
  if redis.call('HGET', key, 'state') == 'promised' and redis.call('HGET', key, 'promised_to') == a.waiter then
    hand_on(f[2], key, KEYS[7], true, KEYS[4], a.queue_prefix, a.waiter_prefix, KEYS[3], a.promised)
  end
end
if a.refusal and a.refusal ~= '' then
  meter(KEYS[8], KEYS[9], KEYS[10], a.workspace, a.retention, 'capacity_refusals', 1)
  event(KEYS[11], a.maxlen, {'type', 'capacity_refusal', 'workspace', a.workspace, 'ts', tostring(a.now),
    'pool', a.pool, 'limit', a.refusal})
end
return 1
