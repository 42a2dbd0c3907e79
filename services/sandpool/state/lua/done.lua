-- uses: deadline meter settle
-- A call ended: meter it, mark the session active and remove the call's record, in one step and only
-- if the record is still there (a `done` sent twice, or after the controller settled the call, does nothing).
-- KEYS[1] the call's record  KEYS[2] call deadlines zset  KEYS[3] session hash  KEYS[4] deadlines zset
-- KEYS[5] usage total hash   KEYS[6] usage day hash       KEYS[7] usage workspaces  KEYS[8] usage event stream
-- ARGV[1] {call (its id), session, workspace, now, retention (usage-day, s), maxlen (stream),
--         event (its type; '' = nothing to meter), tool ('' = none),
--         amounts ([field, amount] pairs: each metered as a total and, with a tool, also as field:tool;
--         all written on the event)}
-- Returns 1 (settled), 0 (no such record of this session and workspace: nothing done).
-- The work ran, so it is metered even when the session was released meanwhile.
local a = cjson.decode(ARGV[1])
local sid, ws = a.session, a.workspace
local rec = redis.call('HMGET', KEYS[1], 'session', 'workspace')
if rec[1] ~= sid or rec[2] ~= ws then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], a.call)
settle(KEYS[3], KEYS[4], sid, ws, tonumber(a.now))
if a.event ~= '' then
  local fields = {'type', a.event, 'workspace', ws, 'ts', a.now, 'session', sid}
  if a.tool ~= '' then
    table.insert(fields, 'tool')
    table.insert(fields, a.tool)
  end
  for _, pair in ipairs(a.amounts) do
    local field, amount = pair[1], tostring(pair[2])
    meter(KEYS[5], KEYS[6], KEYS[7], ws, a.retention, field, amount)
    if a.tool ~= '' then meter(KEYS[5], KEYS[6], KEYS[7], ws, a.retention, field .. ':' .. a.tool, amount) end
    table.insert(fields, field)
    table.insert(fields, amount)
  end
  event(KEYS[8], a.maxlen, fields)
end
return 1
