-- Shared Lua helpers: counters into the workspace's total and UTC-day hashes, and the
-- usage event. Fields ending in "seconds" are floats; the others are integer counts.
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
