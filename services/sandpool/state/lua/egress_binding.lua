-- The session an egress credential is bound to, if that session still lives, with the workspace limits
-- its lease recorded on it (where the egress proxy finds max_egress_connections).
-- KEYS[1] the credential's binding hash
-- ARGV[1] {session_prefix}
-- Returns {session, workspace, allow JSON, lease limits JSON} or nil. A binding whose session is gone (or
-- now belongs to another workspace) is deleted here: a released sandbox's credential admits nothing,
-- whether or not the release removed its binding.
local a = cjson.decode(ARGV[1])
local f = redis.call('HMGET', KEYS[1], 'session', 'workspace', 'allow')
if not f[1] or not f[2] then return nil end
local s = redis.call('HMGET', a.session_prefix .. f[1], 'workspace', 'limits')
if s[1] ~= f[2] then
  redis.call('DEL', KEYS[1])
  return nil
end
return {f[1], f[2], f[3] or '[]', s[2] or '{}'}
