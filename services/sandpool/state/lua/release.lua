-- uses: meter
-- Release a session (destroy, reap, dead agent, admin): meter its session-seconds, doom its sandbox.
-- KEYS[1] session hash   KEYS[2] deadlines zset   KEYS[3] doomed set
-- KEYS[4] usage workspaces set                    KEYS[5] usage event stream
-- ARGV[1] {session, workspace (required; '' = any: the session reaper, an admin), now,
--         mode (destroy | reap | dead | abandoned | admin), sandbox_prefix, retention (usage-day, s),
--         maxlen (stream), nudge (pool events channel), released (channel: every api replica ends the
--         session's calls in flight), egress_prefix (key prefix of egress credential bindings: the
--         sandbox's binding is removed, its credential stops working at once); keys around the
--         workspace or the pool, each [head, tail]: ws_sessions, total (usage), day (usage),
--         leased (the pool's leased set), releases (the pool's release-rate bucket, per 10 seconds)}
-- Returns {reason, session_seconds, address, sandbox, workspace, pool} or nil (nothing released).
-- `reap` re-checks the deadline here, so replicas racing over one session are harmless.
local a = cjson.decode(ARGV[1])
local sid, now, mode = a.session, tonumber(a.now), a.mode
local f = redis.call('HMGET', KEYS[1], 'workspace', 'sandbox', 'created_at', 'max_lifetime_seconds',
  'address', 'pool')
if not f[1] then
  if mode == 'reap' then redis.call('ZREM', KEYS[2], sid) end
  return nil
end
local ws = f[1]
if a.workspace ~= '' and ws ~= a.workspace then return nil end
local reason = mode
if mode == 'reap' then
  local score = redis.call('ZSCORE', KEYS[2], sid)
  if score and tonumber(score) > now then return nil end
  if now >= tonumber(f[3]) + tonumber(f[4]) then reason = 'lifetime' else reason = 'idle' end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], sid)
redis.call('SREM', a.ws_sessions[1] .. ws .. a.ws_sessions[2], sid)
local sandbox = f[2]
local sandbox_key = a.sandbox_prefix .. sandbox
local owner = redis.call('HMGET', sandbox_key, 'session', 'egress')
if owner[1] == sid then
  redis.call('HSET', sandbox_key, 'state', 'doomed')
  if owner[2] and owner[2] ~= '' then redis.call('DEL', a.egress_prefix .. owner[2]) end
end
redis.call('SREM', a.leased[1] .. (f[6] or '') .. a.leased[2], sandbox)
redis.call('SADD', KEYS[3], sandbox)
local seconds = math.max(0, now - tonumber(f[3]))
local used = string.format('%.3f', seconds)
meter(a.total[1] .. ws .. a.total[2], a.day[1] .. ws .. a.day[2], KEYS[4], ws, a.retention, 'session_seconds', used)
event(KEYS[5], a.maxlen, {'type', 'session_released', 'workspace', ws, 'ts', a.now, 'session', sid,
  'pool', f[6], 'sandbox', sandbox, 'reason', reason, 'session_seconds', used})
redis.call('PUBLISH', a.nudge, sandbox)
redis.call('PUBLISH', a.released, sid)
local bucket = a.releases[1] .. (f[6] or '') .. a.releases[2]
redis.call('INCR', bucket)
redis.call('EXPIRE', bucket, 120)
return {reason, used, f[5], sandbox, ws, f[6]}
