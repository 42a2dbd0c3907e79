-- uses: admission
-- Revocation, rate and policy of one request, in one round trip.
-- KEYS[1] rate counter of (workspace, UTC minute)    KEYS[2] the workspace's policy (JSON string)
-- KEYS[3] optional: the token's revocation marker
-- ARGV[1] {count (true: count this request against the rate), expiry (the counter's, seconds)}
-- Returns {revoked 0|1, count after this request (0 when not counted or revoked), policy JSON or ''}.
local a = cjson.decode(ARGV[1])
local revoked, count, policy = admission(KEYS[1], KEYS[2], KEYS[3], a.count, a.expiry)
if revoked then return {1, 0, ''} end
return {0, count, policy}
