-- Delete an MCP session (its DELETE).
-- KEYS[1] MCP session hash
-- ARGV[1] {workspace}
-- Returns {default session or ''} (the caller releases it); nil when unknown or another workspace's
-- (left untouched).
local a = cjson.decode(ARGV[1])
if redis.call('HGET', KEYS[1], 'workspace') ~= a.workspace then return nil end
local session = redis.call('HGET', KEYS[1], 'session') or ''
redis.call('DEL', KEYS[1])
return {session}
