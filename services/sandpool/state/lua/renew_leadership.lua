-- Compare-and-renew of the leader key. KEYS[1] leader key; ARGV: replica_id, leadership_ms -> 1 still ours, 0 lost.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
