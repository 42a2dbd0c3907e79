-- The next sessions of a workspace, with what their handles show: a step of listing them.
-- KEYS[1] the workspace's sessions set   KEYS[2] deadlines sorted set
-- ARGV[1] {session_prefix, fields (the session hash fields a handle may show, in order), cursor (where this
--         look at the set goes on: '0' to begin), count (members looked at: an SSCAN step)}
-- Returns {the next cursor ('0': every member has been looked at), {session id, deadline, then the values of
-- `fields`, ... for each member}}; a value that is not there is nil. One script per step instead of two
-- commands per session: listing 1,000 sessions through a pipeline held the api's event loop ~75 ms.
local a = cjson.decode(ARGV[1])
local step = redis.call('SSCAN', KEYS[1], a.cursor, 'COUNT', a.count)
local out = {}
local n = 0
for _, session in ipairs(step[2]) do
  out[n + 1] = session
  out[n + 2] = redis.call('ZSCORE', KEYS[2], session)
  n = n + 2
  local values = redis.call('HMGET', a.session_prefix .. session, unpack(a.fields))
  for i = 1, #a.fields do
    out[n + i] = values[i]
  end
  n = n + #a.fields
end
return {step[1], out}
