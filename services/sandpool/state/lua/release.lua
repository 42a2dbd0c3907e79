-- uses: meter release
-- Release a session (destroy, reap, dead agent, admin): meter its session-seconds, doom its sandbox.
-- KEYS[1] session hash   KEYS[2] deadlines zset   KEYS[3] doomed set
-- KEYS[4] usage workspaces set                    KEYS[5] usage event stream
-- ARGV[1] {session, workspace (required; '' = any: the session reaper, an admin), now,
--         mode (destroy | reap | dead | abandoned | admin), sandbox_prefix, retention (usage-day, s),
--         maxlen (stream), nudge (pool events channel), released (channel: every api replica ends the
--         session's calls in flight; a message names a session, or the reaper's several space-separated),
--         egress_prefix (key prefix of egress credential bindings: the
--         sandbox's binding is removed, its credential stops working at once); keys around the
--         workspace or the pool, each [head, tail]: ws_sessions, total (usage), day (usage),
--         leased (the pool's leased set), releases (the pool's release-rate bucket, per 10 seconds)}
-- Returns {reason, session_seconds, address, sandbox, workspace, pool} or nil (nothing released).
-- `reap` re-checks the deadline here, so replicas racing over one session are harmless (the reaper
-- itself releases by reap.lua, which reads what is due in the same script).
local a = cjson.decode(ARGV[1])
return release_session(a, KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
