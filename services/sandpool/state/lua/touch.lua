-- uses: touch
-- Resolve a session for a call and record the call (standalone: the edge's ADMIT_CALL does it with auth on).
-- KEYS[1] session hash   KEYS[2] deadlines zset   KEYS[3] the call's record   KEYS[4] call deadlines zset
-- ARGV[1] session id     ARGV[2] caller's workspace   ARGV[3] now   ARGV[4] busy-for seconds
-- ARGV[5] call id        ARGV[6] tool ('' for a file call)        ARGV[7] the record's grace, seconds
-- Returns {address, secret, exec_timeout, max_exec_timeout} or nil (unknown, or not the caller's).
local now, busy_for = tonumber(ARGV[3]), tonumber(ARGV[4])
local target = touch(KEYS[1], KEYS[2], ARGV[1], ARGV[2], now, busy_for)
if target then record(KEYS[3], KEYS[4], ARGV[5], ARGV[1], ARGV[2], ARGV[6], now, now + busy_for + tonumber(ARGV[7])) end
return target
