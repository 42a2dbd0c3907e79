-- uses: meter settle
-- Settle calls whose `done` never came by their deadline (the api that ran them crashed): an Execute
-- is metered as an unconfirmed call (in `executions`, its tool's count with no execution time, and
-- `unconfirmed_executions`); every record is removed and its session's deadline reset to its idle
-- timeout from now. A `done` arriving later finds no record and does nothing: counted once.
-- KEYS[1] call deadlines zset  KEYS[2] deadlines zset  KEYS[3] usage workspaces set  KEYS[4] usage event stream
-- ARGV[1] now  ARGV[2] most calls to settle  ARGV[3] call key prefix  ARGV[4] session key prefix
-- ARGV[5], ARGV[6]  usage total key = ARGV[5] .. workspace .. ARGV[6]
-- ARGV[7], ARGV[8]  usage day key   = ARGV[7] .. workspace .. ARGV[8]
-- ARGV[9] usage-day retention (s)  ARGV[10] stream maxlen
-- Returns {calls settled, of which executions metered}.
local now, settled, metered = tonumber(ARGV[1]), 0, 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))) do
  local key = ARGV[3] .. id
  local rec = redis.call('HMGET', key, 'session', 'workspace', 'tool')
  redis.call('DEL', key)
  redis.call('ZREM', KEYS[1], id)
  if rec[1] and rec[2] then
    local sid, ws, tool = rec[1], rec[2], rec[3] or ''
    settle(ARGV[4] .. sid, KEYS[2], sid, ws, now)
    settled = settled + 1
    if tool ~= '' then
      local total, day = ARGV[5] .. ws .. ARGV[6], ARGV[7] .. ws .. ARGV[8]
      meter(total, day, KEYS[3], ws, ARGV[9], 'executions', 1)
      meter(total, day, KEYS[3], ws, ARGV[9], 'executions:' .. tool, 1)
      meter(total, day, KEYS[3], ws, ARGV[9], 'unconfirmed_executions', 1)
      event(KEYS[4], ARGV[10], {'type', 'execution', 'workspace', ws, 'ts', ARGV[1], 'session', sid,
        'tool', tool, 'executions', '1', 'unconfirmed_executions', '1'})
      metered = metered + 1
    end
  end
end
return {settled, metered}
