-- Bind a freshly leased sandpool session as the MCP session's default, unless one is bound already.
-- KEYS[1] MCP session hash
-- ARGV[1] {workspace, session}
-- Returns the bound session (the caller releases its own when another call bound first); nil when the
-- MCP session is gone or another workspace's (left untouched).
local a = cjson.decode(ARGV[1])
if redis.call('HGET', KEYS[1], 'workspace') ~= a.workspace then return nil end
redis.call('HSETNX', KEYS[1], 'session', a.session)
return redis.call('HGET', KEYS[1], 'session')
