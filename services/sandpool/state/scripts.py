"""Every Lua script sandpool runs: each state change is one atomic script, one round trip.

Each script documents its KEYS and ARGV at its top. Keys that depend on data read
inside the script (the workspace of a session being released, a sandbox's hash)
are built in Lua from prefixes computed by `state.keys`, so the key schema stays
in one module; every key carries the installation's hash tag, so a script still
touches a single cluster slot.

Times are the caller's clock (the api's or the controller's: POSIX seconds, passed in), never a figure from
inside a sandbox. Usage counters and the usage event are written by the same
script as the state change they meter, so a crash can neither lose nor
double-count them.

Sandbox states: starting -> ready -> leased -> doomed (-> gone). A `ready` sandbox
is in its pool's ready list; a `leased` one in its pool's leased set (which the
ceiling checks count); a `doomed` one in the doomed set the controller drains.
"""

from __future__ import annotations

from sandpool.state.channels import LEASE_NUDGE_PREFIX

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

# Shared Lua helpers of leasing and waiting: the waiters' round-robin queue, promising a sandbox to
# a waiter, the per-10-second rate buckets, and granting a sandbox to a new session.
_WAITING = r"""
local function bump(prefix, bucket)
  local key = prefix .. bucket
  redis.call('INCR', key)
  redis.call('EXPIRE', key, 120)
end

local function rate(prefix, bucket)
  local total = 0
  for i = 0, 5 do total = total + tonumber(redis.call('GET', prefix .. (bucket - i)) or '0') end
  return total
end

-- The next queued waiter, round-robin across workspaces (ids whose waiter is gone are skipped).
local function next_waiter(ring, queue_prefix, waiter_prefix, queued)
  for _ = 1, 64 do
    local ws = redis.call('LPOP', ring)
    if not ws then return nil end
    local qkey = queue_prefix .. ws
    local id = redis.call('LPOP', qkey)
    if redis.call('LLEN', qkey) > 0 then redis.call('RPUSH', ring, ws) end
    if id then
      redis.call('SREM', queued, id)
      if redis.call('HGET', waiter_prefix .. id, 'state') == 'queued' then return id end
    end
  end
  return nil
end

-- Hand a ready sandbox to the next waiter (their api replica claims it), or back to the ready list.
local function hand_on(sandbox, sandbox_key, ready, front, ring, queue_prefix, waiter_prefix, queued, channel)
  local waiter = next_waiter(ring, queue_prefix, waiter_prefix, queued)
  if waiter then
    redis.call('HSET', sandbox_key, 'state', 'promised', 'promised_to', waiter)
    redis.call('HSET', waiter_prefix .. waiter, 'state', 'promised', 'sandbox', sandbox)
    redis.call('PUBLISH', channel, waiter)
    return 2
  end
  redis.call('HSET', sandbox_key, 'state', 'ready')
  redis.call('HDEL', sandbox_key, 'promised_to')
  if front then redis.call('LPUSH', ready, sandbox) else redis.call('RPUSH', ready, sandbox) end
  return 1
end
"""

# Writes a leased sandbox's new session. `a` is the lease (see LEASE); `k` names the keys; `egress`
# is the digest of the sandbox's egress credential ('' or false when it has none).
_GRANT = r"""
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
  redis.call('ZADD', k.deadlines, math.min(now + lifetime, now + idle), a.session)
  redis.call('SADD', k.ws_sessions, a.session)
  if redis.call('TTL', k.ws_sessions) < expiry then redis.call('EXPIRE', k.ws_sessions, expiry) end
  meter(k.usage_total, k.usage_day, k.usage_workspaces, a.workspace, a.retention, 'sessions_created', 1)
  event(k.events, a.maxlen, {'type', 'session_created', 'workspace', a.workspace, 'ts', tostring(a.now),
    'session', a.session, 'pool', a.pool, 'image', a.image, 'sandbox', sandbox})
  redis.call('PUBLISH', a.nudge, '""" + LEASE_NUDGE_PREFIX + r"""' .. sandbox)
end
"""

# The lease itself, as a function LEASE and ADMIT_LEASE both run (its KEYS and ARGV: see LEASE).
_LEASE = r"""
-- Lease a ready sandbox for a new session, within the workspace's lease limits; with none ready,
-- queue the caller as a waiter instead (the controller starts a sandbox for each waiter at once, or
-- as soon as a release frees a slot under the ceiling, and promises them to the waiters in order,
-- round-robin across workspaces).
-- KEYS[1] pool ready list        KEYS[2] the new session's hash   KEYS[3] deadlines zset
-- KEYS[4] workspace sessions set KEYS[5] usage total hash          KEYS[6] usage day hash
-- KEYS[7] usage workspaces set   KEYS[8] usage event stream       KEYS[9] doomed set
-- KEYS[10] pool leased set       KEYS[11] pool waiters set        KEYS[12] pool queued set
-- KEYS[13] pool wait ring        KEYS[14] the workspace's wait queue in the pool
-- KEYS[15] the waiter's hash     KEYS[16] workspace waiters set
-- ARGV[1] the lease, JSON: {session, workspace, pool, image, now, idle, lifetime, exec, max_exec,
--         limits: {name: value (0: none)}, ceiling, wait (seconds a waiter may wait; 0: never wait),
--         bucket (now // 10), lease_rate_prefix, release_rate_prefix, retention, maxlen,
--         expiry_margin, nudge (channel), sandbox_prefix, session_prefix, waiter_prefix,
--         egress_allow (the workspace's egress allow-list as a JSON list, in a string),
--         egress_prefix (key prefix of egress credential bindings)}
-- Returns {'ok', sandbox, address, secret} | {'wait', releases it waits for past the ceiling (0: a start),
--         releases in the last minute} | {'quota', limit} | {'capacity', waiters, releases in the last minute}.
local function lease()
  local a = cjson.decode(ARGV[1])
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
    'queued_at', tostring(a.now), 'lease', ARGV[1], 'behind', behind, 'releases', releases)
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
"""

LEASE = _METER + _WAITING + _GRANT + _LEASE + r"""
return lease()
"""

CLAIM = _METER + _WAITING + _GRANT + r"""
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
"""

CANCEL_WAIT = _METER + _WAITING + r"""
-- A waiter stops waiting (its wait ended, or its client left): it leaves the queue, and a sandbox
-- promised to it goes to the next waiter or back to the ready list (it was never leased).
-- KEYS[1] the waiter's hash      KEYS[2] pool waiters set          KEYS[3] pool queued set
-- KEYS[4] pool wait ring         KEYS[5] the workspace's wait queue in the pool
-- KEYS[6] workspace waiters set  KEYS[7] pool ready list
-- KEYS[8] usage total hash       KEYS[9] usage day hash    KEYS[10] usage workspaces set
-- KEYS[11] usage event stream
-- ARGV[1] {waiter, workspace, pool, now, refusal (the wait ran out: meter a capacity refusal with this
--          limit; '' for none), retention,
--          maxlen, sandbox_prefix, queue_prefix, waiter_prefix, promised (channel)}, JSON
-- Returns 1.
local a = cjson.decode(ARGV[1])
local f = redis.call('HMGET', KEYS[1], 'state', 'sandbox')
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], a.waiter)
redis.call('SREM', KEYS[3], a.waiter)
redis.call('SREM', KEYS[6], a.waiter)
redis.call('LREM', KEYS[5], 0, a.waiter)
if redis.call('LLEN', KEYS[5]) == 0 then redis.call('LREM', KEYS[4], 0, a.workspace) end
if f[1] == 'promised' and f[2] and f[2] ~= '' then
  local key = a.sandbox_prefix .. f[2]
  if redis.call('HGET', key, 'state') == 'promised' and redis.call('HGET', key, 'promised_to') == a.waiter then
    hand_on(f[2], key, KEYS[7], true, KEYS[4], a.queue_prefix, a.waiter_prefix, KEYS[3], a.promised)
  end
end
if a.refusal and a.refusal ~= '' then
  meter(KEYS[8], KEYS[9], KEYS[10], a.workspace, a.retention, 'capacity_refusals', 1)
  event(KEYS[11], a.maxlen, {'type', 'capacity_refusal', 'workspace', a.workspace, 'ts', tostring(a.now),
    'pool', a.pool, 'limit', a.refusal})
end
return 1
"""

# Shared by TOUCH and ADMIT_CALL: resolve a session for a call, mark it busy, record the call.
_TOUCH = r"""
-- The session must exist, belong to the caller and not be past its deadline; the deadline is
-- extended over the call (never past the max lifetime) and a call is marked in flight.
-- Returns {address, secret, exec_timeout, max_exec_timeout}, or nil (unknown, or not the caller's).
local function touch(session_key, deadlines_key, sid, workspace, now, busy_for)
  local f = redis.call('HMGET', session_key, 'workspace', 'address', 'secret', 'created_at',
    'idle_timeout_seconds', 'max_lifetime_seconds', 'exec_timeout_seconds', 'max_exec_timeout_seconds')
  if not f[1] or f[1] ~= workspace then return nil end
  local score = redis.call('ZSCORE', deadlines_key, sid)
  if not score or tonumber(score) <= now then return nil end
  local cap = tonumber(f[4]) + tonumber(f[6])
  local deadline = math.min(cap, now + busy_for + tonumber(f[5]))
  if deadline > tonumber(score) then redis.call('ZADD', deadlines_key, 'XX', deadline, sid) end
  redis.call('HINCRBY', session_key, 'inflight', 1)
  return {f[2], f[3], f[7], f[8]}
end

-- The record of an admitted call: what its `done` meters and removes, and what the controller settles
-- should no `done` come by `deadline` (the api that ran it crashed). No expiry of its own.
local function record(call_key, call_deadlines_key, call_id, sid, workspace, tool, now, deadline)
  redis.call('HSET', call_key, 'session', sid, 'workspace', workspace, 'tool', tool,
    'started', tostring(now), 'deadline', tostring(deadline))
  redis.call('ZADD', call_deadlines_key, deadline, call_id)
end
"""

# Shared by DONE and SETTLE_OVERDUE: a call of the session ended (confirmed or not).
_SETTLE = r"""
-- One call fewer in flight, and the session's deadline back to its idle timeout from `now` (another
-- call still in flight keeps the extension it was given; never past the max lifetime).
local function settle(session_key, deadlines_key, sid, workspace, now)
  if redis.call('HGET', session_key, 'workspace') ~= workspace then return end
  local inflight = redis.call('HINCRBY', session_key, 'inflight', -1)
  if inflight < 0 then
    redis.call('HSET', session_key, 'inflight', 0)
    inflight = 0
  end
  local f = redis.call('HMGET', session_key, 'created_at', 'idle_timeout_seconds', 'max_lifetime_seconds')
  local deadline = math.min(tonumber(f[1]) + tonumber(f[3]), now + tonumber(f[2]))
  local score = redis.call('ZSCORE', deadlines_key, sid)
  if score then
    if inflight > 0 then deadline = math.max(deadline, tonumber(score)) end
    redis.call('ZADD', deadlines_key, 'XX', deadline, sid)
  end
  redis.call('HSET', session_key, 'last_activity_at', tostring(now))
end
"""

TOUCH = _TOUCH + r"""
-- Resolve a session for a call and record the call (standalone: the edge's ADMIT_CALL does it with auth on).
-- KEYS[1] session hash   KEYS[2] deadlines zset   KEYS[3] the call's record   KEYS[4] call deadlines zset
-- ARGV[1] session id     ARGV[2] caller's workspace   ARGV[3] now   ARGV[4] busy-for seconds
-- ARGV[5] call id        ARGV[6] tool ('' for a file call)        ARGV[7] the record's grace, seconds
-- Returns {address, secret, exec_timeout, max_exec_timeout} or nil (unknown, or not the caller's).
local now, busy_for = tonumber(ARGV[3]), tonumber(ARGV[4])
local target = touch(KEYS[1], KEYS[2], ARGV[1], ARGV[2], now, busy_for)
if target then record(KEYS[3], KEYS[4], ARGV[5], ARGV[1], ARGV[2], ARGV[6], now, now + busy_for + tonumber(ARGV[7])) end
return target
"""

DONE = _METER + _SETTLE + r"""
-- A call ended: meter it, mark the session active and remove the call's record, in one step and only
-- if the record is still there (a `done` sent twice, or after the controller settled the call, does nothing).
-- KEYS[1] the call's record  KEYS[2] call deadlines zset  KEYS[3] session hash  KEYS[4] deadlines zset
-- KEYS[5] usage total hash   KEYS[6] usage day hash       KEYS[7] usage workspaces  KEYS[8] usage event stream
-- ARGV[1] call id  ARGV[2] session id  ARGV[3] workspace  ARGV[4] now  ARGV[5] usage-day retention (s)
-- ARGV[6] stream maxlen  ARGV[7] event type ('' = nothing to meter)  ARGV[8] tool ('' = none)
-- ARGV[9..] field, amount pairs: each metered as a total and, with a tool, also as field:tool;
--           all written on the event.
-- Returns 1 (settled), 0 (no such record of this session and workspace: nothing done).
-- The work ran, so it is metered even when the session was released meanwhile.
local sid, ws = ARGV[2], ARGV[3]
local rec = redis.call('HMGET', KEYS[1], 'session', 'workspace')
if rec[1] ~= sid or rec[2] ~= ws then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
settle(KEYS[3], KEYS[4], sid, ws, tonumber(ARGV[4]))
if ARGV[7] ~= '' then
  local fields = {'type', ARGV[7], 'workspace', ws, 'ts', ARGV[4], 'session', sid}
  if ARGV[8] ~= '' then
    table.insert(fields, 'tool')
    table.insert(fields, ARGV[8])
  end
  for i = 9, #ARGV, 2 do
    meter(KEYS[5], KEYS[6], KEYS[7], ws, ARGV[5], ARGV[i], ARGV[i + 1])
    if ARGV[8] ~= '' then meter(KEYS[5], KEYS[6], KEYS[7], ws, ARGV[5], ARGV[i] .. ':' .. ARGV[8], ARGV[i + 1]) end
    table.insert(fields, ARGV[i])
    table.insert(fields, ARGV[i + 1])
  end
  event(KEYS[8], ARGV[6], fields)
end
return 1
"""

SETTLE_OVERDUE = _METER + _SETTLE + r"""
-- Settle calls whose `done` never came by their deadline (the api that ran them crashed): an Execute
-- is metered as an unconfirmed call (in `executions`, its tool's count with no execution time, and
-- `unconfirmed_executions`); every record is removed and its session's deadline reset to its idle
-- timeout from now. A `done` arriving later finds no record and does nothing: counted once.
-- KEYS[1] call deadlines zset  KEYS[2] deadlines zset  KEYS[3] usage workspaces set  KEYS[4] usage event stream
-- ARGV[1] now  ARGV[2] most calls to settle  ARGV[3] call key prefix  ARGV[4] session key prefix
-- ARGV[5], ARGV[6]  usage total key = ARGV[5] .. workspace .. ARGV[6]
-- ARGV[7], ARGV[8]  usage day key   = ARGV[7] .. workspace .. ARGV[8]
-- ARGV[9] usage-day retention (s)  ARGV[10] stream maxlen
-- Returns {calls settled, of which executions metered}.
local now, settled, metered = tonumber(ARGV[1]), 0, 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))) do
  local key = ARGV[3] .. id
  local rec = redis.call('HMGET', key, 'session', 'workspace', 'tool')
  redis.call('DEL', key)
  redis.call('ZREM', KEYS[1], id)
  if rec[1] and rec[2] then
    local sid, ws, tool = rec[1], rec[2], rec[3] or ''
    settle(ARGV[4] .. sid, KEYS[2], sid, ws, now)
    settled = settled + 1
    if tool ~= '' then
      local total, day = ARGV[5] .. ws .. ARGV[6], ARGV[7] .. ws .. ARGV[8]
      meter(total, day, KEYS[3], ws, ARGV[9], 'executions', 1)
      meter(total, day, KEYS[3], ws, ARGV[9], 'executions:' .. tool, 1)
      meter(total, day, KEYS[3], ws, ARGV[9], 'unconfirmed_executions', 1)
      event(KEYS[4], ARGV[10], {'type', 'execution', 'workspace', ws, 'ts', ARGV[1], 'session', sid,
        'tool', tool, 'executions', '1', 'unconfirmed_executions', '1'})
      metered = metered + 1
    end
  end
end
return {settled, metered}
"""

RELEASE = _METER + r"""
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
"""

POOL_STATS = r"""
-- Count a pool's sandboxes by state (read only; bounded by the pool's ceiling).
-- KEYS[1] pool members set   ARGV[1] sandbox key prefix
-- Returns {starting, ready, leased, doomed}.
-- (A sandbox promised to a waiter counts as leased: it is taken.)
local counts = {starting = 0, ready = 0, leased = 0, doomed = 0}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local state = redis.call('HGET', ARGV[1] .. id, 'state')
  if state == 'promised' then state = 'leased' end
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

PUBLISH_READY = _WAITING + r"""
-- A started sandbox's agent answers: promise it to the next waiter, or make it leasable.
-- KEYS[1] sandbox hash, KEYS[2] pool ready list, KEYS[3] pool members set, KEYS[4] pool wait ring,
-- KEYS[5] pool queued set
-- ARGV: sandbox_id, address, secret, ready_at, record_ttl_ms, wait queue prefix, waiter prefix,
--       promised channel, egress (digest of the sandbox's egress credential; '' when it has none)
-- -> 2 promised to a waiter, 1 published ready; 0 the record is no longer `starting` (forgotten or
--    doomed meanwhile): the caller must destroy what it created, nobody else will lease it.
if redis.call('HGET', KEYS[1], 'state') ~= 'starting'
   or redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'address', ARGV[2], 'secret', ARGV[3], 'ready_at', ARGV[4])
if ARGV[9] and ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'egress', ARGV[9]) end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return hand_on(ARGV[1], KEYS[1], KEYS[2], false, KEYS[4], ARGV[6], ARGV[7], KEYS[5], ARGV[8])
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

SWEEP_WAITERS = _WAITING + r"""
-- Forget waiters whose api replica vanished (their hash expired) and hand on what was promised to them.
-- KEYS[1] pool waiters set, KEYS[2] pool queued set, KEYS[3] pool wait ring, KEYS[4] pool ready list,
-- KEYS[5] pool members set
-- ARGV: waiter prefix, sandbox prefix, wait queue prefix, promised channel
-- -> how many waiters were forgotten plus how many promised sandboxes were handed on.
local fixed = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then
    redis.call('SREM', KEYS[1], id)
    redis.call('SREM', KEYS[2], id)
    fixed = fixed + 1
  end
end
for _, sandbox in ipairs(redis.call('SMEMBERS', KEYS[5])) do
  local key = ARGV[2] .. sandbox
  local f = redis.call('HMGET', key, 'state', 'promised_to')
  if f[1] == 'promised' and (not f[2] or redis.call('HGET', ARGV[1] .. f[2], 'sandbox') ~= sandbox) then
    hand_on(sandbox, key, KEYS[4], true, KEYS[3], ARGV[3], ARGV[1], KEYS[2], ARGV[4])
    fixed = fixed + 1
  end
end
return fixed
"""

LOST = r"""
-- The provider says a sandbox died on its own: nobody may lease it any more. A ready one leaves the
-- ready list now (atomically with leases), a promised one's waiter is queued again; either is doomed.
-- (A leased one's session is released by the release script: its reason is `dead`.)
-- KEYS[1] sandbox hash, KEYS[2] pool ready list, KEYS[3] doomed set, KEYS[4] pool queued set,
-- KEYS[5] pool wait ring
-- ARGV: sandbox_id, waiter prefix, wait queue prefix, nudge channel
-- -> {state before, session ('' when none)}.
local f = redis.call('HMGET', KEYS[1], 'state', 'session', 'promised_to')
local state = f[1] or ''
if state == 'ready' or state == 'starting' then
  redis.call('LREM', KEYS[2], 0, ARGV[1])
elseif state == 'promised' and f[3] then
  local waiter = ARGV[2] .. f[3]
  local w = redis.call('HMGET', waiter, 'state', 'workspace')
  if w[1] == 'promised' then
    redis.call('HSET', waiter, 'state', 'queued', 'sandbox', '')
    redis.call('SADD', KEYS[4], f[3])
    if redis.call('LPUSH', ARGV[3] .. w[2], f[3]) == 1 then redis.call('LPUSH', KEYS[5], w[2]) end
  end
end
if state ~= '' and state ~= 'leased' and state ~= 'doomed' then
  redis.call('HSET', KEYS[1], 'state', 'doomed')
  redis.call('SADD', KEYS[3], ARGV[1])
end
redis.call('PUBLISH', ARGV[4], ARGV[1])
return {state, f[2] or ''}
"""

# --- the controller's leadership -------------------------------------------------------------

RENEW_LEADERSHIP = r"""
-- Compare-and-renew of the leader key. KEYS[1] leader key; ARGV: replica_id, leadership_ms -> 1 still ours, 0 lost.
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

# --- the edge's admission -------------------------------------------------------------------

# Shared by ADMIT and ADMIT_CALL: revocation, the rate window and the policy.
_ADMISSION = r"""
-- A revoked token is refused before it is counted, so it cannot spend the workspace's rate.
-- Returns revoked (true: nothing counted), the count after this request (0 when not counted), and
-- the policy JSON ('' when none is stored).
local function admission(rate_key, policy_key, revoked_key, counted, expiry)
  if revoked_key and redis.call('EXISTS', revoked_key) == 1 then return true, 0, '' end
  local count = 0
  if counted then
    count = redis.call('INCR', rate_key)
    if count == 1 then redis.call('EXPIRE', rate_key, tonumber(expiry)) end
  end
  return false, count, redis.call('GET', policy_key) or ''
end
"""

# Shared by ADMIT_CALL and ADMIT_LEASE: the workspace's rate limit decided in the script.
_RATE = r"""
-- The verdict on a counted request from the workspace's policy JSON ('' when none is stored) and the
-- operator's ceiling of requests per minute (0: none): 'unreadable' (not JSON), 'rate' (over the limit),
-- or nil (admitted).
local function rate_verdict(policy, count, counted, ceiling)
  local own = 0
  if policy ~= '' then
    local ok, decoded = pcall(cjson.decode, policy)
    if not ok or type(decoded) ~= 'table' then return 'unreadable' end
    if type(decoded['requests_per_minute']) == 'number' then own = decoded['requests_per_minute'] end
  end
  local limit = own
  if own > 0 and ceiling > 0 then limit = math.min(own, ceiling) elseif own <= 0 then limit = ceiling end
  if counted and limit > 0 and count > limit then return 'rate' end
  return nil
end
"""

ADMIT = _ADMISSION + r"""
-- Revocation, rate and policy of one request, in one round trip.
-- KEYS[1] rate counter of (workspace, UTC minute)    KEYS[2] the workspace's policy (JSON string)
-- KEYS[3] optional: the token's revocation marker
-- ARGV[1] '1' to count this request against the rate, '0' not to    ARGV[2] counter expiry, seconds
-- Returns {revoked 0|1, count after this request (0 when not counted or revoked), policy JSON or ''}.
local revoked, count, policy = admission(KEYS[1], KEYS[2], KEYS[3], ARGV[1] == '1', ARGV[2])
if revoked then return {1, 0, ''} end
return {0, count, policy}
"""

ADMIT_CALL = _ADMISSION + _RATE + _TOUCH + r"""
-- Admission, the session's touch and the call's record, in one round trip: revocation, the rate window
-- and the policy (as ADMIT), then, only if admitted, the session resolved and marked busy and the call
-- recorded (as TOUCH). A refusal is decided before anything is extended, marked in flight or recorded;
-- a call to an unknown or another workspace's session is still counted against the rate (probing ids
-- is not free).
-- KEYS[1] rate counter of (workspace, UTC minute)   KEYS[2] the workspace's policy (JSON string)
-- KEYS[3] session hash   KEYS[4] deadlines zset     KEYS[5] the call's record   KEYS[6] call deadlines zset
-- KEYS[7] optional: the token's revocation marker
-- ARGV[1] '1' to count this request against the rate, '0' not to   ARGV[2] counter expiry, seconds
-- ARGV[3] the operator's ceiling of requests per minute (0: none)  ARGV[4] session id
-- ARGV[5] caller's workspace   ARGV[6] now   ARGV[7] busy-for seconds
-- ARGV[8] call id   ARGV[9] tool ('' for a file call)   ARGV[10] the record's grace, seconds
-- Returns {verdict, count, policy JSON or '', address, secret, exec_timeout, max_exec_timeout}, the
-- last four only when the verdict is 'ok'. Verdicts: 'revoked' (not counted), 'unreadable' (the
-- policy is not JSON), 'rate' (over the workspace's limit), 'unknown' (no such session of this
-- workspace, or past its deadline), 'ok'.
local counted = ARGV[1] == '1'
local revoked, count, policy = admission(KEYS[1], KEYS[2], KEYS[7], counted, ARGV[2])
if revoked then return {'revoked', 0, ''} end
local refused = rate_verdict(policy, count, counted, tonumber(ARGV[3]))
if refused then return {refused, count, policy} end
local now, busy_for = tonumber(ARGV[6]), tonumber(ARGV[7])
local target = touch(KEYS[3], KEYS[4], ARGV[4], ARGV[5], now, busy_for)
if not target then return {'unknown', count, policy} end
record(KEYS[5], KEYS[6], ARGV[8], ARGV[4], ARGV[5], ARGV[9], now, now + busy_for + tonumber(ARGV[10]))
return {'ok', count, policy, target[1], target[2], target[3], target[4]}
"""

ADMIT_LEASE = _ADMISSION + _RATE + _METER + _WAITING + _GRANT + _LEASE + r"""
-- A warm CreateSession in one round trip: the edge's admission (revocation, the rate window and the
-- policy, as ADMIT_CALL), then, only if admitted under the very policy the lease was computed from,
-- the lease (as LEASE). A policy changed since the api read it is answered with the current one and
-- nothing leased: the api computes the lease again and sends it with the rate not counted twice.
-- KEYS[1..16] as LEASE's       KEYS[17] rate counter of (workspace, UTC minute)
-- KEYS[18] the workspace's policy (JSON string)      KEYS[19] optional: the token's revocation marker
-- ARGV[1] the lease, as LEASE's   ARGV[2] '1' to count this request against the rate, '0' not to
-- ARGV[3] counter expiry, seconds  ARGV[4] the operator's ceiling of requests per minute (0: none)
-- ARGV[5] SHA-1 of the policy JSON the lease was computed from ('' for none stored)
-- Returns {'revoked' | 'unreadable' | 'rate' | 'policy', count, policy JSON or ''} when not admitted (the
-- last: admitted, but under another policy than the lease's), else LEASE's answer.
local counted = ARGV[2] == '1'
local revoked, count, policy = admission(KEYS[17], KEYS[18], KEYS[19], counted, ARGV[3])
if revoked then return {'revoked', 0, ''} end
local refused = rate_verdict(policy, count, counted, tonumber(ARGV[4]))
if refused then return {refused, count, policy} end
local digest = ''
if policy ~= '' then digest = redis.sha1hex(policy) end
if digest ~= ARGV[5] then return {'policy', count, policy} end
return lease()
"""

# --- the egress proxy ---------------------------------------------------------------------------

EGRESS_BINDING = r"""
-- The session an egress credential is bound to, if that session still lives, with the workspace limits
-- its lease recorded on it (where the egress proxy finds max_egress_connections).
-- KEYS[1] the credential's binding hash   ARGV[1] session key prefix
-- Returns {session, workspace, allow JSON, lease limits JSON} or nil. A binding whose session is gone (or
-- now belongs to another workspace) is deleted here: a released sandbox's credential admits nothing,
-- whether or not the release removed its binding.
local f = redis.call('HMGET', KEYS[1], 'session', 'workspace', 'allow')
if not f[1] or not f[2] then return nil end
local s = redis.call('HMGET', ARGV[1] .. f[1], 'workspace', 'limits')
if s[1] ~= f[2] then
  redis.call('DEL', KEYS[1])
  return nil
end
return {f[1], f[2], f[3] or '[]', s[2] or '{}'}
"""

EGRESS_METER = _METER + r"""
-- Meter one egress connection when it ends: counters and one `egress` event, in one step.
-- KEYS[1] usage total hash   KEYS[2] usage day hash   KEYS[3] usage workspaces set   KEYS[4] usage event stream
-- ARGV[1] workspace  ARGV[2] session  ARGV[3] now  ARGV[4] usage-day retention (s)  ARGV[5] stream maxlen
-- ARGV[6] bytes in (to the sandbox)  ARGV[7] bytes out (from the sandbox)  ARGV[8] in + out
-- ARGV[9] destination host  ARGV[10] destination port
local ws = ARGV[1]
meter(KEYS[1], KEYS[2], KEYS[3], ws, ARGV[4], 'egress_bytes', ARGV[8])
meter(KEYS[1], KEYS[2], KEYS[3], ws, ARGV[4], 'egress_bytes_in', ARGV[6])
meter(KEYS[1], KEYS[2], KEYS[3], ws, ARGV[4], 'egress_bytes_out', ARGV[7])
meter(KEYS[1], KEYS[2], KEYS[3], ws, ARGV[4], 'egress_connections', 1)
event(KEYS[4], ARGV[5], {'type', 'egress', 'workspace', ws, 'ts', ARGV[3], 'session', ARGV[2],
  'host', ARGV[9], 'port', ARGV[10], 'egress_bytes', ARGV[8], 'egress_bytes_in', ARGV[6],
  'egress_bytes_out', ARGV[7]})
return 1
"""
