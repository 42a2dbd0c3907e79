-- Open an MCP session (previous protocol revision): its hash names the workspace that opened it.
-- KEYS[1] MCP session hash
-- ARGV[1] {workspace, ttl_ms}
-- Returns 1.
local a = cjson.decode(ARGV[1])
redis.call('HSET', KEYS[1], 'workspace', a.workspace)
redis.call('PEXPIRE', KEYS[1], a.ttl_ms)
return 1
