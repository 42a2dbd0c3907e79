-- uses: deadline touch
-- Resolve a session for a call and record the call (standalone: the edge's ADMIT_CALL does it with auth on).
-- KEYS[1] session hash   KEYS[2] deadlines zset   KEYS[3] the call's record   KEYS[4] call deadlines zset
-- ARGV[1] {session, workspace (the caller's), now, busy_for (seconds), call (its id),
--         tool ('' for a file call), grace (the record's, seconds)}
-- Returns {address, secret, exec_timeout, max_exec_timeout} or nil (unknown, or not the caller's).
local a = cjson.decode(ARGV[1])
local now = tonumber(a.now)
local target = touch(KEYS[1], KEYS[2], a.session, a.workspace, now, a.busy_for)
if target then record(KEYS[3], KEYS[4], a.call, a.session, a.workspace, a.tool, now, now + a.busy_for + a.grace) end
return target
