-- uses: meter release
-- The session reaper's step: release up to `limit` sessions whose deadline has passed (oldest first),
-- each as release.lua does in mode `reap`, in one round trip, the counters of each workspace and pool
-- written once for the call (lib/release.lua's `batch`). The limit keeps one call short
-- (a release is tens of microseconds of Redis time): the reaper calls it again while it finds a full one.
-- KEYS[1] deadlines zset   KEYS[2] doomed set   KEYS[3] usage workspaces set   KEYS[4] usage event stream
-- ARGV[1] {now, limit, session_prefix, and release.lua's arguments but session, workspace and mode}
-- Returns {examined, {session, reason, session_seconds, sandbox, workspace}...}: `examined` ids were due
-- (a stale one, whose session hash is gone, is dropped from the index without a release).
local a = cjson.decode(ARGV[1])
a.workspace, a.mode = '', 'reap'
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', a.now, 'LIMIT', 0, a.limit)
local out = {#due}
local batch = {seconds = {}, releases = {}, sessions = {}}
for _, sid in ipairs(due) do
  a.session = sid
  local ok, r = pcall(release_session, a, a.session_prefix .. sid, KEYS[1], KEYS[2], KEYS[3], KEYS[4], batch)
  if not ok then
    -- A script's writes stand when it fails: the sessions released before this one are metered
    -- before the error goes on, as they were when each release wrote its own counters.
    flush_releases(a, batch, KEYS[3])
    error(r)
  end
  if r then out[#out + 1] = {sid, r[1], r[2], r[4], r[5]} end
end
flush_releases(a, batch, KEYS[3])
return out
