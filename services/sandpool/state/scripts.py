"""Every Lua script sandpool runs: each state change is one atomic script, one round trip.

Each script documents its KEYS and ARGV at its top. Keys that depend on data read
inside the script (the workspace of a session being released, a sandbox's hash)
are built in Lua from prefixes computed by `state.keys`, so the key schema stays
in one module; every key carries the installation's hash tag, so a script still
touches a single cluster slot.

Times are the scheduler's clock (POSIX seconds, passed in), never a figure from
inside a sandbox. Usage counters and the usage event are written by the same
script as the state change they meter, so a crash can neither lose nor
double-count them.

Sandbox states: starting -> ready -> leased -> doomed (-> gone). A `ready` sandbox
is in its pool's ready list; a `leased` one in its pool's leased set (which the
ceiling checks count); a `doomed` one in the doomed set the controller drains.
"""

from __future__ import annotations

# Shared Lua helpers: counters into the workspace's total and UTC-day hashes, and the
# usage event. Fields ending in "seconds" are floats; the others are integer counts.
_METER = r"""
local function meter(total_key, day_key, workspaces_key, workspace, retention, field, amount)
  if string.find(field, 'seconds', 1, true) then
    redis.call('HINCRBYFLOAT', total_key, field, amount)
    redis.call('HINCRBYFLOAT', day_key, field, amount)
  else
    redis.call('HINCRBY', total_key, field, amount)
    redis.call('HINCRBY', day_key, field, amount)
  end
  redis.call('EXPIRE', day_key, retention)
  redis.call('SADD', workspaces_key, workspace)
end

local function event(stream_key, maxlen, fields)
  redis.call('XADD', stream_key, 'MAXLEN', '~', maxlen, '*', unpack(fields))
end
"""

LEASE = _METER + r"""
-- Lease a ready sandbox for a new session, enforcing the workspace's lease limits.
-- KEYS[1] pool ready list        KEYS[2] the new session's hash   KEYS[3] deadlines zset
-- KEYS[4] workspace sessions set KEYS[5] usage total hash          KEYS[6] usage day hash
-- KEYS[7] usage workspaces set   KEYS[8] usage event stream       KEYS[9] doomed set
-- KEYS[10] pool leased set
-- ARGV[1] the lease, JSON: {session, workspace, pool, image, now, idle, lifetime, exec, max_exec,
--         limits: {name: value (0: none)}, meter_refusal (bool), retention, maxlen, expiry_margin,
--         nudge (channel), sandbox_prefix, session_prefix}
-- Returns {'ok', sandbox, address, secret} | {'quota', limit} | {'capacity'}.
local a = cjson.decode(ARGV[1])
local ws_key, sid, ws, now = KEYS[4], a.session, a.workspace, tonumber(a.now)
local limits = a.limits or {}

local function refuse(field, kind, extra, always)
  if always or a.meter_refusal then
    meter(KEYS[5], KEYS[6], KEYS[7], ws, a.retention, field, 1)
    event(KEYS[8], a.maxlen, {'type', kind, 'workspace', ws, 'ts', tostring(a.now), 'pool', a.pool,
      'limit', extra})
  end
end

local max_concurrent = tonumber(limits.max_concurrent_sessions or 0)
if max_concurrent > 0 and redis.call('SCARD', ws_key) >= max_concurrent then
  -- Drop ids whose session hash expired without a release (the keys' safety net), then recount.
  for _, member in ipairs(redis.call('SMEMBERS', ws_key)) do
    if redis.call('EXISTS', a.session_prefix .. member) == 0 then redis.call('SREM', ws_key, member) end
  end
  if redis.call('SCARD', ws_key) >= max_concurrent then
    refuse('quota_refusals', 'quota_refusal', 'max_concurrent_sessions', true)
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
    refuse('quota_refusals', 'quota_refusal', 'daily_session_seconds_budget', true)
    return {'quota', 'daily_session_seconds_budget'}
  end
end

-- Pop until a sandbox that is really ready (a reconciler may have doomed one still listed);
-- a "ready" record without an address or secret is broken: doom it rather than lease it.
local sandbox, sandbox_key, found
for _ = 1, 64 do
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  local key = a.sandbox_prefix .. id
  local f = redis.call('HMGET', key, 'state', 'address', 'secret')
  if f[1] == 'ready' then
    if f[2] and f[3] and f[2] ~= '' and f[3] ~= '' then
      sandbox, sandbox_key, found = id, key, {f[2], f[3]}
      break
    end
    redis.call('HSET', key, 'state', 'doomed')
    redis.call('SADD', KEYS[9], id)
  end
end
if not sandbox then
  refuse('capacity_refusals', 'capacity_refusal', 'capacity', false)
  return {'capacity'}
end

redis.call('HSET', sandbox_key, 'state', 'leased', 'session', sid, 'leased_at', tostring(a.now))
redis.call('SADD', KEYS[10], sandbox)
local idle, lifetime = tonumber(a.idle), tonumber(a.lifetime)
redis.call('HSET', KEYS[2], 'sandbox', sandbox, 'pool', a.pool, 'image', a.image, 'workspace', ws,
  'address', found[1], 'secret', found[2], 'created_at', tostring(a.now), 'last_activity_at', tostring(a.now),
  'idle_timeout_seconds', idle, 'max_lifetime_seconds', lifetime, 'exec_timeout_seconds', a.exec,
  'max_exec_timeout_seconds', a.max_exec, 'limits', cjson.encode(limits), 'inflight', 0)
local expiry = lifetime + tonumber(a.expiry_margin)
redis.call('EXPIRE', KEYS[2], expiry)
redis.call('ZADD', KEYS[3], math.min(now + lifetime, now + idle), sid)
redis.call('SADD', ws_key, sid)
if redis.call('TTL', ws_key) < expiry then redis.call('EXPIRE', ws_key, expiry) end
meter(KEYS[5], KEYS[6], KEYS[7], ws, a.retention, 'sessions_created', 1)
event(KEYS[8], a.maxlen, {'type', 'session_created', 'workspace', ws, 'ts', tostring(a.now), 'session', sid,
  'pool', a.pool, 'image', a.image, 'sandbox', sandbox})
redis.call('PUBLISH', a.nudge, sandbox)
return {'ok', sandbox, found[1], found[2]}
"""

TOUCH = r"""
-- Resolve a session for a call: it must exist, belong to the caller and not be past its
-- deadline. Marks a call in flight and extends the deadline over it.
-- KEYS[1] session hash   KEYS[2] deadlines zset
-- ARGV[1] session id     ARGV[2] caller's workspace   ARGV[3] now   ARGV[4] busy-for seconds
-- Returns {address, secret, exec_timeout, max_exec_timeout} or nil (unknown, or not the caller's).
local f = redis.call('HMGET', KEYS[1], 'workspace', 'address', 'secret', 'created_at',
  'idle_timeout_seconds', 'max_lifetime_seconds', 'exec_timeout_seconds', 'max_exec_timeout_seconds')
if not f[1] or f[1] ~= ARGV[2] then return nil end
local now = tonumber(ARGV[3])
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not score or tonumber(score) <= now then return nil end
local cap = tonumber(f[4]) + tonumber(f[6])
local deadline = math.min(cap, now + tonumber(ARGV[4]) + tonumber(f[5]))
if deadline > tonumber(score) then redis.call('ZADD', KEYS[2], 'XX', deadline, ARGV[1]) end
redis.call('HINCRBY', KEYS[1], 'inflight', 1)
return {f[2], f[3], f[7], f[8]}
"""

DONE = _METER + r"""
-- After a forwarded call: meter it and mark the session active.
-- KEYS[1] session hash       KEYS[2] deadlines zset    KEYS[3] usage total hash
-- KEYS[4] usage day hash     KEYS[5] usage workspaces  KEYS[6] usage event stream
-- ARGV[1] session id  ARGV[2] workspace  ARGV[3] now  ARGV[4] usage-day retention (s)
-- ARGV[5] stream maxlen  ARGV[6] event type ('' = nothing to meter)  ARGV[7] tool ('' = none)
-- ARGV[8..] field, amount pairs: each metered as a total and, with a tool, also as field:tool;
--           all written on the event.
-- The work ran, so it is metered even when the session was released meanwhile.
local sid, ws, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('HGET', KEYS[1], 'workspace') == ws then
  local inflight = redis.call('HINCRBY', KEYS[1], 'inflight', -1)
  if inflight < 0 then
    redis.call('HSET', KEYS[1], 'inflight', 0)
    inflight = 0
  end
  local f = redis.call('HMGET', KEYS[1], 'created_at', 'idle_timeout_seconds', 'max_lifetime_seconds')
  local deadline = math.min(tonumber(f[1]) + tonumber(f[3]), now + tonumber(f[2]))
  local score = redis.call('ZSCORE', KEYS[2], sid)
  if score then
    -- Another call still in flight keeps the extension it was given.
    if inflight > 0 then deadline = math.max(deadline, tonumber(score)) end
    redis.call('ZADD', KEYS[2], 'XX', deadline, sid)
  end
  redis.call('HSET', KEYS[1], 'last_activity_at', ARGV[3])
end
if ARGV[6] ~= '' then
  local fields = {'type', ARGV[6], 'workspace', ws, 'ts', ARGV[3], 'session', sid}
  if ARGV[7] ~= '' then
    table.insert(fields, 'tool')
    table.insert(fields, ARGV[7])
  end
  for i = 8, #ARGV, 2 do
    meter(KEYS[3], KEYS[4], KEYS[5], ws, ARGV[4], ARGV[i], ARGV[i + 1])
    if ARGV[7] ~= '' then meter(KEYS[3], KEYS[4], KEYS[5], ws, ARGV[4], ARGV[i] .. ':' .. ARGV[7], ARGV[i + 1]) end
    table.insert(fields, ARGV[i])
    table.insert(fields, ARGV[i + 1])
  end
  event(KEYS[6], ARGV[5], fields)
end
return 1
"""

RELEASE = _METER + r"""
-- Release a session (destroy, reap, dead agent, admin): meter its session-seconds, doom its sandbox.
-- KEYS[1] session hash   KEYS[2] deadlines zset   KEYS[3] doomed set
-- KEYS[4] usage workspaces set                    KEYS[5] usage event stream
-- ARGV[1] session id     ARGV[2] required workspace ('' = any: the reaper, an admin)
-- ARGV[3] now            ARGV[4] mode: destroy | reap | dead | abandoned | admin
-- ARGV[5] sandbox key prefix
-- ARGV[6], ARGV[7]  workspace-sessions key = ARGV[6] .. workspace .. ARGV[7]
-- ARGV[8], ARGV[9]  usage total key        = ARGV[8] .. workspace .. ARGV[9]
-- ARGV[10], ARGV[11] usage day key         = ARGV[10] .. workspace .. ARGV[11]
-- ARGV[12] usage-day retention (s)  ARGV[13] stream maxlen  ARGV[14] pool events channel
-- ARGV[15], ARGV[16] pool leased set key   = ARGV[15] .. pool .. ARGV[16]
-- ARGV[17] released-sessions channel (every scheduler replica ends the session's calls in flight)
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
if redis.call('HGET', sandbox_key, 'session') == sid then
  redis.call('HSET', sandbox_key, 'state', 'doomed')
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
return {reason, used, f[5], sandbox, ws, f[6]}
"""

POOL_STATS = r"""
-- Count a pool's sandboxes by state (read only; bounded by the pool's ceiling).
-- KEYS[1] pool members set   ARGV[1] sandbox key prefix
-- Returns {starting, ready, leased, doomed}.
local counts = {starting = 0, ready = 0, leased = 0, doomed = 0}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local state = redis.call('HGET', ARGV[1] .. id, 'state')
  if state and counts[state] then counts[state] = counts[state] + 1 end
end
return {counts.starting, counts.ready, counts.leased, counts.doomed}
"""

# --- the pool controller's steps -------------------------------------------------------------

REGISTER_STARTING = r"""
-- Register a sandbox about to be created, unless its pool is at its ceiling.
-- KEYS[1] sandbox hash, KEYS[2] pool members set
-- ARGV: sandbox_id, ceiling, pool, image, created_at, owner, record_ttl_ms
-- -> 1 registered (state=starting), 0 the pool is at its ceiling.
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'starting', 'pool', ARGV[3], 'image', ARGV[4],
           'created_at', ARGV[5], 'owner', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

PUBLISH_READY = r"""
-- A started sandbox's agent answers: make it leasable.
-- KEYS[1] sandbox hash, KEYS[2] pool ready list, KEYS[3] pool members set
-- ARGV: sandbox_id, address, secret, ready_at, record_ttl_ms
-- -> 1 published; 0 the record is no longer `starting` (forgotten or doomed meanwhile):
--    the caller must destroy what it created, nobody else will lease it.
if redis.call('HGET', KEYS[1], 'state') ~= 'starting'
   or redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'ready', 'address', ARGV[2], 'secret', ARGV[3],
           'ready_at', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
"""

FORGET = r"""
-- Drop every trace of a sandbox the provider no longer runs.
-- KEYS[1] sandbox hash, KEYS[2] pool members set, KEYS[3] pool ready list, KEYS[4] doomed set,
-- KEYS[5] pool leased set
-- ARGV: sandbox_id
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('LREM', KEYS[3], 0, ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
return 1
"""

RETIRE_SURPLUS = r"""
-- Doom ready sandboxes above the target. Atomic with the lease script.
-- KEYS[1] pool ready list, KEYS[2] doomed set
-- ARGV: sandbox key prefix, how many
-- -> how many ready sandboxes were doomed. The newest go (leases take the oldest); a listed id
--    that is no longer `ready` is only dropped from the list.
local retired = 0
for _ = 1, tonumber(ARGV[2]) do
  local id = redis.call('RPOP', KEYS[1])
  if not id then break end
  local key = ARGV[1] .. id
  if redis.call('HGET', key, 'state') == 'ready' then
    redis.call('HSET', key, 'state', 'doomed')
    redis.call('SADD', KEYS[2], id)
    retired = retired + 1
  end
end
return retired
"""

# --- the controller's leader lease ------------------------------------------------------------

RENEW_LEADERSHIP = r"""
-- Compare-and-renew of the leader key. KEYS[1] leader key; ARGV: replica_id, lease_ms -> 1 still ours, 0 lost.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

RELEASE_LEADERSHIP = r"""
-- Compare-and-delete of the leader key. KEYS[1] leader key; ARGV: replica_id -> 1 released, 0 not ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# --- the proxy's admission ------------------------------------------------------------------

ADMIT = r"""
-- Revocation, rate and policy of one request, in one round trip.
-- KEYS[1] rate counter of (workspace, UTC minute)    KEYS[2] the workspace's policy (JSON string)
-- KEYS[3] optional: the token's revocation marker
-- ARGV[1] '1' to count this request against the rate, '0' not to    ARGV[2] counter expiry, seconds
-- Returns {revoked 0|1, count after this request (0 when not counted or revoked), policy JSON or ''}.
-- A revoked token is refused before it is counted, so it cannot spend the workspace's rate.
if #KEYS >= 3 and redis.call('EXISTS', KEYS[3]) == 1 then
  return {1, 0, ''}
end
local count = 0
if ARGV[1] == '1' then
  count = redis.call('INCR', KEYS[1])
  if count == 1 then
    redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
  end
end
local policy = redis.call('GET', KEYS[2])
if not policy then
  policy = ''
end
return {0, count, policy}
"""
