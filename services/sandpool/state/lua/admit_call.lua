-- uses: admission rate touch
-- Admission, the session's touch and the call's record, in one round trip: revocation, the rate window
-- and the policy (as ADMIT), then, only if admitted, the session resolved and marked busy and the call
-- recorded (as TOUCH). A refusal is decided before anything is extended, marked in flight or recorded;
-- a call to an unknown or another workspace's session is still counted against the rate (probing ids
-- is not free).
-- KEYS[1] rate counter of (workspace, UTC minute)   KEYS[2] the workspace's policy (JSON string)
-- KEYS[3] session hash   KEYS[4] deadlines zset     KEYS[5] the call's record   KEYS[6] call deadlines zset
-- KEYS[7] optional: the token's revocation marker
-- ARGV[1] '1' to count this request against the rate, '0' not to   ARGV[2] counter expiry, seconds
-- ARGV[3] the operator's ceiling of requests per minute (0: none)  ARGV[4] session id
-- ARGV[5] caller's workspace   ARGV[6] now   ARGV[7] busy-for seconds
-- ARGV[8] call id   ARGV[9] tool ('' for a file call)   ARGV[10] the record's grace, seconds
-- Returns {verdict, count, policy JSON or '', address, secret, exec_timeout, max_exec_timeout}, the
-- last four only when the verdict is 'ok'. Verdicts: 'revoked' (not counted), 'unreadable' (the
-- policy is not JSON), 'rate' (over the workspace's limit), 'unknown' (no such session of this
-- workspace, or past its deadline), 'ok'.
local counted = ARGV[1] == '1'
local revoked, count, policy = admission(KEYS[1], KEYS[2], KEYS[7], counted, ARGV[2])
if revoked then return {'revoked', 0, ''} end
local refused = rate_verdict(policy, count, counted, tonumber(ARGV[3]))
if refused then return {refused, count, policy} end
local now, busy_for = tonumber(ARGV[6]), tonumber(ARGV[7])
local target = touch(KEYS[3], KEYS[4], ARGV[4], ARGV[5], now, busy_for)
if not target then return {'unknown', count, policy} end
record(KEYS[5], KEYS[6], ARGV[8], ARGV[4], ARGV[5], ARGV[9], now, now + busy_for + tonumber(ARGV[10]))
return {'ok', count, policy, target[1], target[2], target[3], target[4]}
