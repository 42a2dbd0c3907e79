-- An MCP session as its own workspace sees it, its idle expiry refreshed.
-- KEYS[1] MCP session hash
-- ARGV[1] {workspace, ttl_ms}
-- Returns {default session or ''}; nil when unknown, expired or another workspace's (left untouched).
local a = cjson.decode(ARGV[1])
if redis.call('HGET', KEYS[1], 'workspace') ~= a.workspace then return nil end
redis.call('PEXPIRE', KEYS[1], a.ttl_ms)
return {redis.call('HGET', KEYS[1], 'session') or ''}
