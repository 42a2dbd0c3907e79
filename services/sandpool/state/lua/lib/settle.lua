-- Shared by DONE and SETTLE_OVERDUE: a call of the session ended (confirmed or not).
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
  local deadline = idle_deadline(f[1], f[2], f[3], now)
  local score = redis.call('ZSCORE', deadlines_key, sid)
  if score then
    if inflight > 0 then deadline = math.max(deadline, tonumber(score)) end
    redis.call('ZADD', deadlines_key, 'XX', deadline, sid)
  end
  redis.call('HSET', session_key, 'last_activity_at', tostring(now))
end
