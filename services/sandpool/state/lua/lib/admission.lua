-- Shared by ADMIT and ADMIT_CALL: revocation, the rate window and the policy.
-- A revoked token is refused before it is counted, so it cannot spend the workspace's rate.
-- Returns revoked (true: nothing counted), the count after this request (0 when not counted), and
-- the policy JSON ('' when none is stored).
local function admission(rate_key, policy_key, revoked_key, counted, expiry)
  if revoked_key and redis.call('EXISTS', revoked_key) == 1 then return true, 0, '' end
  local count = 0
  if counted then
    count = redis.call('INCR', rate_key)
    if count == 1 then redis.call('EXPIRE', rate_key, tonumber(expiry)) end
  end
  return false, count, redis.call('GET', policy_key) or ''
end
