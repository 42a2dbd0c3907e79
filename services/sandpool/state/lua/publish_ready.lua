-- uses: waiting
-- A started sandbox's agent answers: promise it to the next waiter, or make it leasable.
-- KEYS[1] sandbox hash   KEYS[2] pool ready list   KEYS[3] pool members set   KEYS[4] pool wait ring
-- KEYS[5] pool queued set   KEYS[6] pool starting set
-- ARGV[1] {sandbox, address, secret, ready_at, record_ttl_ms, queue_prefix (the pool's wait queues),
--         waiter_prefix, promised (channel), egress (digest of the sandbox's egress credential; '' when none)}
-- Returns 2 promised to a waiter, 1 published ready; 0 the record is no longer `starting` (forgotten or
-- doomed meanwhile): the caller must destroy what it created, nobody else will lease it.
local a = cjson.decode(ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'starting'
   or redis.call('SISMEMBER', KEYS[3], a.sandbox) == 0 then
  return 0
end
redis.call('SREM', KEYS[6], a.sandbox)
redis.call('HSET', KEYS[1], 'address', a.address, 'secret', a.secret, 'ready_at', a.ready_at)
if a.egress ~= '' then redis.call('HSET', KEYS[1], 'egress', a.egress) end
redis.call('PEXPIRE', KEYS[1], a.record_ttl_ms)
return hand_on(a.sandbox, KEYS[1], KEYS[2], false, KEYS[4], a.queue_prefix, a.waiter_prefix, KEYS[5], a.promised)
