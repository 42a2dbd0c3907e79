-- uses: meter
-- Meter one egress connection when it ends: counters and one `egress` event, in one step.
-- KEYS[1] usage total hash   KEYS[2] usage day hash   KEYS[3] usage workspaces set   KEYS[4] usage event stream
-- ARGV[1] workspace  ARGV[2] session  ARGV[3] now  ARGV[4] usage-day retention (s)  ARGV[5] stream maxlen
-- ARGV[6] bytes in (to the sandbox)  ARGV[7] bytes out (from the sandbox)  ARGV[8] in + out
-- ARGV[9] destination host  ARGV[10] destination port
local ws = ARGV[1]
meter(KEYS[1], KEYS[2], KEYS[3], ws, ARGV[4], 'egress_bytes', ARGV[8])
meter(KEYS[1], KEYS[2], KEYS[3], ws, ARGV[4], 'egress_bytes_in', ARGV[6])
meter(KEYS[1], KEYS[2], KEYS[3], ws, ARGV[4], 'egress_bytes_out', ARGV[7])
meter(KEYS[1], KEYS[2], KEYS[3], ws, ARGV[4], 'egress_connections', 1)
event(KEYS[4], ARGV[5], {'type', 'egress', 'workspace', ws, 'ts', ARGV[3], 'session', ARGV[2],
  'host', ARGV[9], 'port', ARGV[10], 'egress_bytes', ARGV[8], 'egress_bytes_in', ARGV[6],
  'egress_bytes_out', ARGV[7]})
return 1
