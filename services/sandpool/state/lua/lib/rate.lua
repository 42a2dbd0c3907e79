-- Shared by ADMIT_CALL and ADMIT_LEASE: the workspace's rate limit decided in the script.
-- The verdict on a counted request from the workspace's policy JSON ('' when none is stored) and the
-- operator's ceiling of requests per minute (0: none): 'unreadable' (not JSON), 'rate' (over the limit),
-- or nil (admitted).
local function rate_verdict(policy, count, counted, ceiling)
  local own = 0
  if policy ~= '' then
    local ok, decoded = pcall(cjson.decode, policy)
    if not ok or type(decoded) ~= 'table' then return 'unreadable' end
    if type(decoded['requests_per_minute']) == 'number' then own = decoded['requests_per_minute'] end
  end
  local limit = own
  if own > 0 and ceiling > 0 then limit = math.min(own, ceiling) elseif own <= 0 then limit = ceiling end
  if counted and limit > 0 and count > limit then return 'rate' end
  return nil
end
