-- Release one session (the body of release.lua, and of reap.lua for each session due): meter its
-- session-seconds, doom its sandbox. `a` holds the arguments release.lua documents (its `session`,
-- `workspace` and `mode` the one session's); the keys are release.lua's KEYS[1] to KEYS[5].
-- `batch` (reap.lua's, else nil): the workspace's session-seconds, the pool's release count, the
-- controller's nudge and the apis' release message are added up there and written once per workspace,
-- pool and call by `flush_releases`, not once per session; the session's own usage event is written
-- here either way.
-- Returns {reason, session_seconds, address, sandbox, workspace, pool} or nil (nothing released).
local function count_releases(a, pool, n)
  local bucket = a.releases[1] .. pool .. a.releases[2]
  redis.call('INCRBY', bucket, n)
  redis.call('EXPIRE', bucket, 120)
end

local function release_session(a, session_key, deadlines, doomed, usage_workspaces, events, batch)
  local sid, now, mode = a.session, tonumber(a.now), a.mode
  local f = redis.call('HMGET', session_key, 'workspace', 'sandbox', 'created_at', 'max_lifetime_seconds',
    'address', 'pool', 'idle_timeout_seconds')
  if not f[1] then
    if mode == 'reap' then redis.call('ZREM', deadlines, sid) end
    return nil
  end
  local ws = f[1]
  if a.workspace ~= '' and ws ~= a.workspace then return nil end
  local reason = mode
  if mode == 'reap' then
    -- Due? reap.lua (`batch`) read it from the deadlines in this same script, so no touch came between;
    -- a direct release in mode `reap` looks again.
    if not batch then
      local score = redis.call('ZSCORE', deadlines, sid)
      if score and tonumber(score) > now then return nil end
    end
    -- Due before its idle timeout could have passed: only the answer's grace (grant.lua) does that.
    if now >= tonumber(f[3]) + tonumber(f[4]) then reason = 'lifetime'
    elseif f[7] and now < tonumber(f[3]) + tonumber(f[7]) then reason = 'unanswered'
    else reason = 'idle' end
  end
  redis.call('DEL', session_key)
  redis.call('ZREM', deadlines, sid)
  redis.call('SREM', a.ws_sessions[1] .. ws .. a.ws_sessions[2], sid)
  local sandbox = f[2]
  local sandbox_key = a.sandbox_prefix .. sandbox
  local owner = redis.call('HMGET', sandbox_key, 'session', 'egress')
  if owner[1] == sid then
    redis.call('HSET', sandbox_key, 'state', 'doomed')
    if owner[2] and owner[2] ~= '' then redis.call('DEL', a.egress_prefix .. owner[2]) end
  end
  redis.call('SREM', a.leased[1] .. (f[6] or '') .. a.leased[2], sandbox)
  redis.call('SADD', doomed, sandbox)
  local seconds = math.max(0, now - tonumber(f[3]))
  local used = string.format('%.3f', seconds)
  event(events, a.maxlen, {'type', 'session_released', 'workspace', ws, 'ts', a.now, 'session', sid,
    'pool', f[6], 'sandbox', sandbox, 'reason', reason, 'session_seconds', used})
  local pool = f[6] or ''
  if batch then
    batch.sessions[#batch.sessions + 1] = sid
    batch.seconds[ws] = (batch.seconds[ws] or 0) + tonumber(used)  -- the metered figure, as the event's
    batch.releases[pool] = (batch.releases[pool] or 0) + 1
    batch.nudge = sandbox
  else
    redis.call('PUBLISH', a.released, sid)
    meter(a.total[1] .. ws .. a.total[2], a.day[1] .. ws .. a.day[2], usage_workspaces, ws, a.retention,
      'session_seconds', used)
    redis.call('PUBLISH', a.nudge, sandbox)
    count_releases(a, pool, 1)
  end
  return {reason, used, f[5], sandbox, ws, pool}
end

-- What `release_session` added up in `batch`, written: once per workspace, once per pool, one nudge, and
-- one message naming every session released (space-separated: the apis' listener splits it).
local function flush_releases(a, batch, usage_workspaces)
  if #batch.sessions > 0 then redis.call('PUBLISH', a.released, table.concat(batch.sessions, ' ')) end
  for ws, seconds in pairs(batch.seconds) do
    meter(a.total[1] .. ws .. a.total[2], a.day[1] .. ws .. a.day[2], usage_workspaces, ws, a.retention,
      'session_seconds', string.format('%.3f', seconds))
  end
  for pool, n in pairs(batch.releases) do count_releases(a, pool, n) end
  if batch.nudge then redis.call('PUBLISH', a.nudge, batch.nudge) end
end
