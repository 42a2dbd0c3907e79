-- Shared Lua helpers of leasing and waiting: the waiters' round-robin queue, promising a sandbox to
-- a waiter, the per-10-second rate buckets, and granting a sandbox to a new session.
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
