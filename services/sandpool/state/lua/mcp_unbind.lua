-- Forget the MCP session's default session, found ended, only if it is still the one bound.
-- KEYS[1] MCP session hash
-- ARGV[1] {workspace, session}
-- Returns 1 when it was forgotten, else 0.
local a = cjson.decode(ARGV[1])
if redis.call('HGET', KEYS[1], 'workspace') ~= a.workspace then return 0 end
if redis.call('HGET', KEYS[1], 'session') ~= a.session then return 0 end
return redis.call('HDEL', KEYS[1], 'session')
