-- uses: deadline admission rate touch
-- Admission, the session's touch and the call's record, in one round trip: revocation, the rate window
-- and the policy (as ADMIT), then, only if admitted, the session resolved and marked busy and the call
-- recorded (as TOUCH). A refusal is decided before anything is extended, marked in flight or recorded;
-- a call to an unknown or another workspace's session is still counted against the rate (probing ids
-- is not free).
-- KEYS[1] rate counter of (workspace, UTC minute)   KEYS[2] the workspace's policy (JSON string)
-- KEYS[3] session hash   KEYS[4] deadlines zset     KEYS[5] the call's record   KEYS[6] call deadlines zset
-- KEYS[7] optional: the token's revocation marker
-- ARGV[1] {count (true: count this request against the rate), expiry (the counter's, seconds),
--         rate_ceiling (the operator's requests per minute; 0: none), session, workspace (the caller's),
--         now, busy_for (seconds), call (its id), tool ('' for a file call), grace (the record's, seconds)}
-- Returns {verdict, count, policy JSON or '', address, secret, exec_timeout, max_exec_timeout}, the
-- last four only when the verdict is 'ok'. Verdicts: 'revoked' (not counted), 'unreadable' (the
-- policy is not JSON), 'rate' (over the workspace's limit), 'unknown' (no such session of this
-- workspace, or past its deadline), 'ok'.
local a = cjson.decode(ARGV[1])
local revoked, count, policy = admission(KEYS[1], KEYS[2], KEYS[7], a.count, a.expiry)
if revoked then return {'revoked', 0, ''} end
local refused = rate_verdict(policy, count, a.count, a.rate_ceiling)
if refused then return {refused, count, policy} end
local now = tonumber(a.now)
local target = touch(KEYS[3], KEYS[4], a.session, a.workspace, now, a.busy_for)
if not target then return {'unknown', count, policy} end
record(KEYS[5], KEYS[6], a.call, a.session, a.workspace, a.tool, now, now + a.busy_for + a.grace)
return {'ok', count, policy, target[1], target[2], target[3], target[4]}
