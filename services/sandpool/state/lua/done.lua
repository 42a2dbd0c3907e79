-- uses: meter settle
-- A call ended: meter it, mark the session active and remove the call's record, in one step and only
-- if the record is still there (a `done` sent twice, or after the controller settled the call, does nothing).
-- KEYS[1] the call's record  KEYS[2] call deadlines zset  KEYS[3] session hash  KEYS[4] deadlines zset
-- KEYS[5] usage total hash   KEYS[6] usage day hash       KEYS[7] usage workspaces  KEYS[8] usage event stream
-- ARGV[1] call id  ARGV[2] session id  ARGV[3] workspace  ARGV[4] now  ARGV[5] usage-day retention (s)
-- ARGV[6] stream maxlen  ARGV[7] event type ('' = nothing to meter)  ARGV[8] tool ('' = none)
-- ARGV[9..] field, amount pairs: each metered as a total and, with a tool, also as field:tool;
--           all written on the event.
-- Returns 1 (settled), 0 (no such record of this session and workspace: nothing done).
-- The work ran, so it is metered even when the session was released meanwhile.
local sid, ws = ARGV[2], ARGV[3]
local rec = redis.call('HMGET', KEYS[1], 'session', 'workspace')
if rec[1] ~= sid or rec[2] ~= ws then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
settle(KEYS[3], KEYS[4], sid, ws, tonumber(ARGV[4]))
if ARGV[7] ~= '' then
  local fields = {'type', ARGV[7], 'workspace', ws, 'ts', ARGV[4], 'session', sid}
  if ARGV[8] ~= '' then
    table.insert(fields, 'tool')
    table.insert(fields, ARGV[8])
  end
  for i = 9, #ARGV, 2 do
    meter(KEYS[5], KEYS[6], KEYS[7], ws, ARGV[5], ARGV[i], ARGV[i + 1])
    if ARGV[8] ~= '' then meter(KEYS[5], KEYS[6], KEYS[7], ws, ARGV[5], ARGV[i] .. ':' .. ARGV[8], ARGV[i + 1]) end
    table.insert(fields, ARGV[i])
    table.insert(fields, ARGV[i + 1])
  end
  event(KEYS[8], ARGV[6], fields)
end
return 1
