-- uses: waiting
-- A started sandbox's agent answers: promise it to the next waiter, or make it leasable.
-- KEYS[1] sandbox hash, KEYS[2] pool ready list, KEYS[3] pool members set, KEYS[4] pool wait ring,
-- KEYS[5] pool queued set
-- ARGV: sandbox_id, address, secret, ready_at, record_ttl_ms, wait queue prefix, waiter prefix,
--       promised channel, egress (digest of the sandbox's egress credential; '' when it has none)
-- -> 2 promised to a waiter, 1 published ready; 0 the record is no longer `starting` (forgotten or
--    doomed meanwhile): the caller must destroy what it created, nobody else will lease it.
if redis.call('HGET', KEYS[1], 'state') ~= 'starting'
   or redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'address', ARGV[2], 'secret', ARGV[3], 'ready_at', ARGV[4])
if ARGV[9] and ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'egress', ARGV[9]) end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return hand_on(ARGV[1], KEYS[1], KEYS[2], false, KEYS[4], ARGV[6], ARGV[7], KEYS[5], ARGV[8])
