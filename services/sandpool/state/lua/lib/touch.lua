-- Shared by TOUCH and ADMIT_CALL: resolve a session for a call, mark it busy, record the call.
-- The session must exist, belong to the caller and not be past its deadline; the deadline is
-- extended over the call (never past the max lifetime) and a call is marked in flight.
-- Returns {address, secret, exec_timeout, max_exec_timeout}, or nil (unknown, or not the caller's).
local function touch(session_key, deadlines_key, sid, workspace, now, busy_for)
  local f = redis.call('HMGET', session_key, 'workspace', 'address', 'secret', 'created_at',
    'idle_timeout_seconds', 'max_lifetime_seconds', 'exec_timeout_seconds', 'max_exec_timeout_seconds')
  if not f[1] or f[1] ~= workspace then return nil end
  local score = redis.call('ZSCORE', deadlines_key, sid)
  if not score or tonumber(score) <= now then return nil end
  local deadline = idle_deadline(f[4], f[5], f[6], now + busy_for)
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
