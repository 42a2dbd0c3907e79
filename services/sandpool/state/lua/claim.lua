-- uses: deadline meter waiting grant
-- A waiter takes the sandbox promised to it, as a new session (the lease it asked for, at `now`).
-- KEYS[1] the waiter's hash      KEYS[2] the new session's hash   KEYS[3] deadlines zset
-- KEYS[4] workspace sessions set KEYS[5] usage total hash          KEYS[6] usage day hash
-- KEYS[7] usage workspaces set   KEYS[8] usage event stream       KEYS[9] pool leased set
-- KEYS[10] pool waiters set      KEYS[11] workspace waiters set    KEYS[12] pool queued set
-- KEYS[13] pool wait ring        KEYS[14] the workspace's wait queue in the pool
-- ARGV[1] {now, bucket, workspace}, JSON
-- Returns {'ok', sandbox, address, secret} | {'waiting'} (nothing promised yet) | {'gone'} (no such waiter).
local given = cjson.decode(ARGV[1])
local f = redis.call('HMGET', KEYS[1], 'state', 'sandbox', 'lease')
if not f[1] then
  -- Claimed already, if sent again after its reply was lost: the session it made, not a refusal.
  local made = redis.call('HMGET', KEYS[2], 'workspace', 'sandbox', 'address', 'secret')
  if made[1] and made[1] == given.workspace then return {'ok', made[2], made[3], made[4]} end
  return {'gone'}
end
if f[1] ~= 'promised' then return {'waiting'} end
local a = cjson.decode(f[3])
a.now, a.bucket = given.now, given.bucket
local sandbox = f[2]
local sandbox_key = a.sandbox_prefix .. sandbox
local s = redis.call('HMGET', sandbox_key, 'state', 'promised_to', 'address', 'secret', 'egress')
if s[1] ~= 'promised' or s[2] ~= a.session then
  -- The promised sandbox was lost meanwhile (destroyed, reconciled): queue again, first in line.
  redis.call('HSET', KEYS[1], 'state', 'queued', 'sandbox', '')
  redis.call('SADD', KEYS[12], a.session)
  if redis.call('LPUSH', KEYS[14], a.session) == 1 then redis.call('LPUSH', KEYS[13], a.workspace) end
  redis.call('PUBLISH', a.nudge, 'wait')
  return {'waiting'}
end
grant(a, sandbox, sandbox_key, s[3], s[4], s[5], {session = KEYS[2], deadlines = KEYS[3], ws_sessions = KEYS[4],
  usage_total = KEYS[5], usage_day = KEYS[6], usage_workspaces = KEYS[7], events = KEYS[8], leased = KEYS[9]})
redis.call('SREM', KEYS[10], a.session)
redis.call('SREM', KEYS[11], a.session)
redis.call('DEL', KEYS[1])
return {'ok', sandbox, s[3], s[4]}
