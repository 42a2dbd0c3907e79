-- uses: meter
-- Meter one egress connection when it ends: counters and one `egress` event, in one step.
-- KEYS[1] usage total hash   KEYS[2] usage day hash   KEYS[3] usage workspaces set   KEYS[4] usage event stream
-- ARGV[1] {workspace, session, now, retention (usage-day, s), maxlen (stream), bytes_in (to the sandbox),
--         bytes_out (from the sandbox), host, port (the destination)}
-- Returns 1.
local a = cjson.decode(ARGV[1])
local ws, total = a.workspace, a.bytes_in + a.bytes_out
meter(KEYS[1], KEYS[2], KEYS[3], ws, a.retention, 'egress_bytes', total)
meter(KEYS[1], KEYS[2], KEYS[3], ws, a.retention, 'egress_bytes_in', a.bytes_in)
meter(KEYS[1], KEYS[2], KEYS[3], ws, a.retention, 'egress_bytes_out', a.bytes_out)
meter(KEYS[1], KEYS[2], KEYS[3], ws, a.retention, 'egress_connections', 1)
event(KEYS[4], a.maxlen, {'type', 'egress', 'workspace', ws, 'ts', a.now, 'session', a.session,
  'host', a.host, 'port', tostring(a.port), 'egress_bytes', tostring(total), 'egress_bytes_in', tostring(a.bytes_in),
  'egress_bytes_out', tostring(a.bytes_out)})
return 1
