-- uses: deadline
-- The api answered these CreateSessions: each session's deadline goes from the answer's grace
-- (grant.lua) to its idle timeout from its creation (never past its max lifetime, never earlier than
-- a call already made it). A session released meanwhile is skipped.
-- KEYS[1] deadlines zset
-- ARGV[1] {session_prefix, sessions: [session id...]}
-- Returns how many sessions were confirmed.
local a = cjson.decode(ARGV[1])
local confirmed = 0
for _, sid in ipairs(a.sessions) do
  local f = redis.call('HMGET', a.session_prefix .. sid, 'created_at', 'idle_timeout_seconds', 'max_lifetime_seconds')
  local score = redis.call('ZSCORE', KEYS[1], sid)
  if f[1] and score then
    local deadline = idle_deadline(f[1], f[2], f[3], tonumber(f[1]))
    if deadline > tonumber(score) then redis.call('ZADD', KEYS[1], 'XX', deadline, sid) end
    confirmed = confirmed + 1
  end
end
return confirmed
