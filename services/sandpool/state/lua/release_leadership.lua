-- Compare-and-delete of the leader key. KEYS[1] leader key; ARGV: replica_id -> 1 released, 0 not ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
