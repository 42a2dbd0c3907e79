-- uses: deadline meter settle
-- Settle calls whose `done` never came by their deadline (the api that ran them crashed): an Execute
-- is metered as an unconfirmed call (in `executions`, its tool's count with no execution time, and
-- `unconfirmed_executions`); every record is removed and its session's deadline reset to its idle
-- timeout from now. A `done` arriving later finds no record and does nothing: counted once.
-- KEYS[1] call deadlines zset  KEYS[2] deadlines zset  KEYS[3] usage workspaces set  KEYS[4] usage event stream
-- ARGV[1] {now, limit (most calls to settle), call_prefix, session_prefix, total (usage total key around the
--         workspace: [head, tail]), day (usage day key, likewise), retention (usage-day, s), maxlen (stream)}
-- Returns {calls settled, of which executions metered}.
local a = cjson.decode(ARGV[1])
local now, settled, metered = tonumber(a.now), 0, 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, a.limit)) do
  local key = a.call_prefix .. id
  local rec = redis.call('HMGET', key, 'session', 'workspace', 'tool')
  redis.call('DEL', key)
  redis.call('ZREM', KEYS[1], id)
  if rec[1] and rec[2] then
    local sid, ws, tool = rec[1], rec[2], rec[3] or ''
    settle(a.session_prefix .. sid, KEYS[2], sid, ws, now)
    settled = settled + 1
    if tool ~= '' then
      local total, day = a.total[1] .. ws .. a.total[2], a.day[1] .. ws .. a.day[2]
      meter(total, day, KEYS[3], ws, a.retention, 'executions', 1)
      meter(total, day, KEYS[3], ws, a.retention, 'executions:' .. tool, 1)
      meter(total, day, KEYS[3], ws, a.retention, 'unconfirmed_executions', 1)
      event(KEYS[4], a.maxlen, {'type', 'execution', 'workspace', ws, 'ts', a.now, 'session', sid,
        'tool', tool, 'executions', '1', 'unconfirmed_executions', '1'})
      metered = metered + 1
    end
  end
end
return {settled, metered}
