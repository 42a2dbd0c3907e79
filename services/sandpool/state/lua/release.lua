-- uses: meter
-- Release a session (destroy, reap, dead agent, admin): meter its session-seconds, doom its sandbox.
-- KEYS[1] session hash   KEYS[2] deadlines zset   KEYS[3] doomed set
-- KEYS[4] usage workspaces set                    KEYS[5] usage event stream
-- ARGV[1] session id     ARGV[2] required workspace ('' = any: the session reaper, an admin)
-- ARGV[3] now            ARGV[4] mode: destroy | reap | dead | abandoned | admin
-- ARGV[5] sandbox key prefix
-- ARGV[6], ARGV[7]  workspace-sessions key = ARGV[6] .. workspace .. ARGV[7]
-- ARGV[8], ARGV[9]  usage total key        = ARGV[8] .. workspace .. ARGV[9]
-- ARGV[10], ARGV[11] usage day key         = ARGV[10] .. workspace .. ARGV[11]
-- ARGV[12] usage-day retention (s)  ARGV[13] stream maxlen  ARGV[14] pool events channel
-- ARGV[15], ARGV[16] pool leased set key   = ARGV[15] .. pool .. ARGV[16]
-- ARGV[17] released-sessions channel (every api replica ends the session's calls in flight)
-- ARGV[18], ARGV[19] release rate bucket key = ARGV[18] .. pool .. ARGV[19] (counted per 10 seconds)
-- ARGV[20] key prefix of egress credential bindings (the sandbox's binding is removed: its credential
--          stops working at once)
-- Returns {reason, session_seconds, address, sandbox, workspace, pool} or nil (nothing released).
-- `reap` re-checks the deadline here, so replicas racing over one session are harmless.
local sid, now, mode = ARGV[1], tonumber(ARGV[3]), ARGV[4]
local f = redis.call('HMGET', KEYS[1], 'workspace', 'sandbox', 'created_at', 'max_lifetime_seconds',
  'address', 'pool')
if not f[1] then
  if mode == 'reap' then redis.call('ZREM', KEYS[2], sid) end
  return nil
end
local ws = f[1]
if ARGV[2] ~= '' and ws ~= ARGV[2] then return nil end
local reason = mode
if mode == 'reap' then
  local score = redis.call('ZSCORE', KEYS[2], sid)
  if score and tonumber(score) > now then return nil end
  if now >= tonumber(f[3]) + tonumber(f[4]) then reason = 'lifetime' else reason = 'idle' end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], sid)
redis.call('SREM', ARGV[6] .. ws .. ARGV[7], sid)
local sandbox = f[2]
local sandbox_key = ARGV[5] .. sandbox
local owner = redis.call('HMGET', sandbox_key, 'session', 'egress')
if owner[1] == sid then
  redis.call('HSET', sandbox_key, 'state', 'doomed')
  if owner[2] and owner[2] ~= '' then redis.call('DEL', ARGV[20] .. owner[2]) end
end
redis.call('SREM', ARGV[15] .. (f[6] or '') .. ARGV[16], sandbox)
redis.call('SADD', KEYS[3], sandbox)
local seconds = math.max(0, now - tonumber(f[3]))
local used = string.format('%.3f', seconds)
meter(ARGV[8] .. ws .. ARGV[9], ARGV[10] .. ws .. ARGV[11], KEYS[4], ws, ARGV[12], 'session_seconds', used)
event(KEYS[5], ARGV[13], {'type', 'session_released', 'workspace', ws, 'ts', ARGV[3], 'session', sid,
  'pool', f[6], 'sandbox', sandbox, 'reason', reason, 'session_seconds', used})
redis.call('PUBLISH', ARGV[14], sandbox)
redis.call('PUBLISH', ARGV[17], sid)
local bucket = ARGV[18] .. (f[6] or '') .. ARGV[19]
redis.call('INCR', bucket)
redis.call('EXPIRE', bucket, 120)
return {reason, used, f[5], sandbox, ws, f[6]}
