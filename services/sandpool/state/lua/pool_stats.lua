-- Count a pool's sandboxes by state from the sizes of its sets and lists: a few O(1) reads whatever
-- the pool's size (it runs on every /metrics scrape; reading each member's state took one call of
-- tens of milliseconds at 100,000 sandboxes: docs/capacity.md).
-- KEYS[1] pool members set   KEYS[2] pool ready list   KEYS[3] pool leased set   KEYS[4] pool starting set
-- KEYS[5] pool waiters set   KEYS[6] pool queued set
-- ARGV[1] {} (no arguments)
-- Returns {starting, ready, leased, doomed}.
-- (A sandbox promised to a waiter counts as leased: it is taken. Promised ones are the waiters not
-- queued any more; doomed ones, those of the members in none of the other states.)
local members = redis.call('SCARD', KEYS[1])
local starting = redis.call('SCARD', KEYS[4])
local ready = redis.call('LLEN', KEYS[2])
local leased = redis.call('SCARD', KEYS[3]) + math.max(0, redis.call('SCARD', KEYS[5]) - redis.call('SCARD', KEYS[6]))
return {starting, ready, leased, math.max(0, members - starting - ready - leased)}
