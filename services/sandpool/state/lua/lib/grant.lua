-- Writes a leased sandbox's new session. `a` is the lease (see LEASE); `k` names the keys; `egress`
-- is the digest of the sandbox's egress credential ('' or false when it has none).
local function grant(a, sandbox, sandbox_key, address, secret, egress, k)
  local now, idle, lifetime = tonumber(a.now), tonumber(a.idle), tonumber(a.lifetime)
  redis.call('HSET', sandbox_key, 'state', 'leased', 'session', a.session, 'leased_at', tostring(a.now))
  redis.call('HDEL', sandbox_key, 'promised_to')
  redis.call('SADD', k.leased, sandbox)
  redis.call('HSET', k.session, 'sandbox', sandbox, 'pool', a.pool, 'image', a.image, 'workspace', a.workspace,
    'address', address, 'secret', secret, 'created_at', tostring(a.now), 'last_activity_at', tostring(a.now),
    'idle_timeout_seconds', idle, 'max_lifetime_seconds', lifetime, 'exec_timeout_seconds', a.exec,
    'max_exec_timeout_seconds', a.max_exec, 'limits', cjson.encode(a.limits or {}), 'inflight', 0)
  local expiry = lifetime + tonumber(a.expiry_margin)
  redis.call('EXPIRE', k.session, expiry)
  if egress and egress ~= '' then
    -- Bind the sandbox's egress credential to this session and its workspace's allow-list (a JSON
    -- list, encoded by the caller), expiring with the session: what the egress proxy reads on every
    -- connection (state/egress.py, `EgressStore.bind` is the reference). Bound even when the list is
    -- empty, so a refusal names the policy. The credential is fresh per sandbox and a sandbox is
    -- leased once, so no earlier binding can be under this key.
    local binding = a.egress_prefix .. egress
    redis.call('HSET', binding, 'session', a.session, 'workspace', a.workspace, 'allow', a.egress_allow or '[]')
    redis.call('EXPIRE', binding, expiry)
  end
  -- Until the api says it answered (answered.lua), the session is due `answer` seconds after its
  -- lease: an api that died between the lease and its answer leaves no sandbox leased for an idle
  -- timeout to a session nobody was told of.
  local deadline = idle_deadline(now, idle, lifetime, now)
  local answer = tonumber(a.answer) or 0
  if answer > 0 then deadline = math.min(deadline, now + answer) end
  redis.call('ZADD', k.deadlines, deadline, a.session)
  redis.call('SADD', k.ws_sessions, a.session)
  if redis.call('TTL', k.ws_sessions) < expiry then redis.call('EXPIRE', k.ws_sessions, expiry) end
  meter(k.usage_total, k.usage_day, k.usage_workspaces, a.workspace, a.retention, 'sessions_created', 1)
  event(k.events, a.maxlen, {'type', 'session_created', 'workspace', a.workspace, 'ts', tostring(a.now),
    'session', a.session, 'pool', a.pool, 'image', a.image, 'sandbox', sandbox})
  redis.call('PUBLISH', a.nudge, '@LEASE_NUDGE_PREFIX@' .. sandbox)
end
