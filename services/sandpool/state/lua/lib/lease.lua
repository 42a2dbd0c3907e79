-- The lease itself, as a function lease.lua and admit_lease.lua both run (KEYS and ARGV: lease.lua).
local function lease(a)
  local ws_key, ws_waiting, ws, now = KEYS[4], KEYS[16], a.workspace, tonumber(a.now)
  local limits = a.limits or {}

  -- The same lease again (redis-py sends a script again when its connection died before the reply):
  -- answer what the first run did, and do nothing twice. Session ids are random per CreateSession.
  local earlier = redis.call('HMGET', KEYS[2], 'workspace', 'sandbox', 'address', 'secret')
  if earlier[1] then
    if earlier[1] ~= ws then return redis.error_reply('session id in use by another workspace') end
    return {'ok', earlier[2], earlier[3], earlier[4]}
  end
  local queued = redis.call('HMGET', KEYS[15], 'workspace', 'behind', 'releases')
  if queued[1] then
    if queued[1] ~= ws then return redis.error_reply('session id in use by another workspace') end
    return {'wait', tonumber(queued[2] or '0'), tonumber(queued[3] or '0')}
  end

  local function refuse(field, kind, extra)
    meter(KEYS[5], KEYS[6], KEYS[7], ws, a.retention, field, 1)
    event(KEYS[8], a.maxlen, {'type', kind, 'workspace', ws, 'ts', tostring(a.now), 'pool', a.pool, 'limit', extra})
  end

  local max_concurrent = tonumber(limits.max_concurrent_sessions or 0)
  if max_concurrent > 0 and redis.call('SCARD', ws_key) + redis.call('SCARD', ws_waiting) >= max_concurrent then
    -- Drop ids whose session or waiter expired without a release (the keys' safety net), then recount.
    for _, member in ipairs(redis.call('SMEMBERS', ws_key)) do
      if redis.call('EXISTS', a.session_prefix .. member) == 0 then redis.call('SREM', ws_key, member) end
    end
    for _, member in ipairs(redis.call('SMEMBERS', ws_waiting)) do
      if redis.call('EXISTS', a.waiter_prefix .. member) == 0 then redis.call('SREM', ws_waiting, member) end
    end
    if redis.call('SCARD', ws_key) + redis.call('SCARD', ws_waiting) >= max_concurrent then
      refuse('quota_refusals', 'quota_refusal', 'max_concurrent_sessions')
      return {'quota', 'max_concurrent_sessions'}
    end
  end

  local budget = tonumber(limits.daily_session_seconds_budget or 0)
  if budget > 0 then
    -- Released sessions were metered into today's hash; live ones count what they used so far.
    local used = tonumber(redis.call('HGET', KEYS[6], 'session_seconds') or '0')
    for _, member in ipairs(redis.call('SMEMBERS', ws_key)) do
      local created = redis.call('HGET', a.session_prefix .. member, 'created_at')
      if created then used = used + math.max(0, now - tonumber(created)) end
    end
    if used >= budget then
      refuse('quota_refusals', 'quota_refusal', 'daily_session_seconds_budget')
      return {'quota', 'daily_session_seconds_budget'}
    end
  end

  -- Pop until a sandbox that is really ready (a reconciler may have doomed one still listed);
  -- a "ready" record without an address or secret is broken: doom it rather than lease it.
  for _ = 1, 64 do
    local id = redis.call('LPOP', KEYS[1])
    if not id then break end
    local key = a.sandbox_prefix .. id
    local f = redis.call('HMGET', key, 'state', 'address', 'secret', 'egress')
    if f[1] == 'ready' then
      if f[2] and f[3] and f[2] ~= '' and f[3] ~= '' then
        bump(a.lease_rate_prefix, a.bucket)  -- demand: a session asked for (the warm target follows it)
        grant(a, id, key, f[2], f[3], f[4], {session = KEYS[2], deadlines = KEYS[3], ws_sessions = ws_key,
          usage_total = KEYS[5], usage_day = KEYS[6], usage_workspaces = KEYS[7], events = KEYS[8],
          leased = KEYS[10]})
        return {'ok', id, f[2], f[3]}
      end
      redis.call('HSET', key, 'state', 'doomed')
      redis.call('SADD', KEYS[9], id)
    end
  end

  -- None ready. Full when every slot up to the ceiling is leased or promised to an earlier waiter:
  -- then the caller waits only if the pool's releases over the last minute free a slot for it (one
  -- release for each caller ahead of it past the ceiling, and its own) within half the wait.
  local waiting, wait = redis.call('SCARD', KEYS[11]), tonumber(a.wait)
  local behind = redis.call('SCARD', KEYS[10]) + waiting + 1 - tonumber(a.ceiling)
  local releases = 0
  if wait <= 0 then
    refuse('capacity_refusals', 'capacity_refusal', 'at_capacity')
    return {'capacity', waiting, rate(a.release_rate_prefix, a.bucket)}
  end
  if behind > 0 then
    releases = rate(a.release_rate_prefix, a.bucket)
    if releases <= 0 or behind * 60 / releases > wait / 2 then
      refuse('capacity_refusals', 'capacity_refusal', 'at_capacity')
      return {'capacity', waiting, releases}
    end
  else
    behind = 0
  end
  bump(a.lease_rate_prefix, a.bucket)  -- demand too, served by a start (the claim does not count it again)
  local waiter = KEYS[15]
  redis.call('HSET', waiter, 'session', a.session, 'workspace', ws, 'pool', a.pool, 'state', 'queued',
    'queued_at', tostring(a.now), 'lease', cjson.encode(a), 'behind', behind, 'releases', releases)
  local ttl = math.ceil(tonumber(a.wait)) + 60
  redis.call('EXPIRE', waiter, ttl)
  redis.call('SADD', KEYS[11], a.session)
  redis.call('SADD', KEYS[12], a.session)
  redis.call('SADD', ws_waiting, a.session)
  if redis.call('TTL', ws_waiting) < ttl then redis.call('EXPIRE', ws_waiting, ttl) end
  if redis.call('RPUSH', KEYS[14], a.session) == 1 then redis.call('RPUSH', KEYS[13], ws) end
  redis.call('EXPIRE', KEYS[14], ttl)
  redis.call('PUBLISH', a.nudge, 'wait')
  return {'wait', behind, releases}
end
