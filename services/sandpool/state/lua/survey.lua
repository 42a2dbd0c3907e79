-- Reconciliation's read of the next members of a pool: each one's record, and whether its session names it.
-- KEYS[1] pool members set
-- ARGV[1] {sandbox_prefix, session_prefix, cursor (where this look at the members goes on: '0' to begin),
--         count (members looked at: an SSCAN step)}
-- Returns {the next cursor ('0': every member has been looked at), {sandbox id, state, session, owner,
-- created_at, the sandbox the session names, ... six per member}}; a field that is not there is nil (a
-- member's pool is the set's: the caller knows it). One
-- script per step instead of one command per record: at 100,000 sandboxes a pass read 200,000 replies,
-- and building and parsing them was most of its CPU (docs/capacity.md).
local a = cjson.decode(ARGV[1])
local step = redis.call('SSCAN', KEYS[1], a.cursor, 'COUNT', a.count)
local out = {}
local n = 0
for _, sandbox in ipairs(step[2]) do
  local f = redis.call('HMGET', a.sandbox_prefix .. sandbox, 'state', 'session', 'owner', 'created_at')
  local named = false
  if f[2] then
    named = redis.call('HGET', a.session_prefix .. f[2], 'sandbox')
  end
  out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5], out[n + 6] = sandbox, f[1], f[2], f[3], f[4], named
  n = n + 6
end
return {step[1], out}
