-- uses: admission
-- Revocation, rate and policy of one request, in one round trip.
-- KEYS[1] rate counter of (workspace, UTC minute)    KEYS[2] the workspace's policy (JSON string)
-- KEYS[3] optional: the token's revocation marker
-- ARGV[1] '1' to count this request against the rate, '0' not to    ARGV[2] counter expiry, seconds
-- Returns {revoked 0|1, count after this request (0 when not counted or revoked), policy JSON or ''}.
local revoked, count, policy = admission(KEYS[1], KEYS[2], KEYS[3], ARGV[1] == '1', ARGV[2])
if revoked then return {1, 0, ''} end
return {0, count, policy}
