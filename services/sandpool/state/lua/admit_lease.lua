-- uses: deadline admission rate meter waiting grant lease
-- A warm CreateSession in one round trip: the edge's admission (revocation, the rate window and the
-- policy, as ADMIT_CALL), then, only if admitted under the very policy the lease was computed from,
-- the lease (as LEASE). A policy changed since the api read it is answered with the current one and
-- nothing leased: the api computes the lease again and sends it with the rate not counted twice.
-- KEYS[1..16] as LEASE's       KEYS[17] rate counter of (workspace, UTC minute)
-- KEYS[18] the workspace's policy (JSON string)      KEYS[19] optional: the token's revocation marker
-- ARGV[1] {lease (as LEASE's ARGV[1]), count (true: count this request against the rate), expiry (the
--         counter's, seconds), rate_ceiling (the operator's requests per minute; 0: none),
--         policy_digest (SHA-1 of the policy JSON the lease was computed from; '' for none stored)}
-- Returns {'revoked' | 'unreadable' | 'rate' | 'policy', count, policy JSON or ''} when not admitted (the
-- last: admitted, but under another policy than the lease's), else LEASE's answer.
local a = cjson.decode(ARGV[1])
local revoked, count, policy = admission(KEYS[17], KEYS[18], KEYS[19], a.count, a.expiry)
if revoked then return {'revoked', 0, ''} end
local refused = rate_verdict(policy, count, a.count, a.rate_ceiling)
if refused then return {refused, count, policy} end
local digest = ''
if policy ~= '' then digest = redis.sha1hex(policy) end
if digest ~= a.policy_digest then return {'policy', count, policy} end
return lease(a.lease)
