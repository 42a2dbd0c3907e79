-- Reconciliation's read of the next members of a pool: each one's state, and whether its session names it.
-- KEYS[1] pool members set
-- ARGV[1] {sandbox_prefix, session_prefix, cursor (where this look at the members goes on: '0' to begin),
--         count (members looked at: an SSCAN step)}
-- Returns {the next cursor ('0': every member has been looked at), {ready, held, others}}:
--   ready  {sandbox id...}: members whose record is `ready` (and names no session);
--   held   {sandbox id, session...}: members `leased` to a session that names them;
--   others {sandbox id, state, session, owner, created_at, the sandbox the session names, ... six per member}:
--          every other member, a field that is not there nil (a member's pool is the set's: the caller
--          knows it).
-- Only the provider can make a ready or held member need an action (it does not run it, or its agent is
-- gone), so those come back as ids alone: at 100,000 sandboxes nearly every member is one, and building
-- and parsing six fields for each was most of a pass's CPU (docs/capacity.md). One script per step
-- instead of one command per record, for the same reason.
local a = cjson.decode(ARGV[1])
local step = redis.call('SSCAN', KEYS[1], a.cursor, 'COUNT', a.count)
local ready, held, others = {}, {}, {}
for _, sandbox in ipairs(step[2]) do
  local f = redis.call('HMGET', a.sandbox_prefix .. sandbox, 'state', 'session', 'owner', 'created_at')
  local named = false
  if f[2] then
    named = redis.call('HGET', a.session_prefix .. f[2], 'sandbox')
  end
  if f[1] == 'ready' and not f[2] then
    ready[#ready + 1] = sandbox
  elseif f[1] == 'leased' and named == sandbox then
    held[#held + 1] = sandbox
    held[#held + 1] = f[2]
  else
    local n = #others
    others[n + 1], others[n + 2], others[n + 3], others[n + 4], others[n + 5], others[n + 6] =
      sandbox, f[1], f[2], f[3], f[4], named
  end
end
return {step[1], {ready, held, others}}
