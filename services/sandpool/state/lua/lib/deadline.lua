-- A session's deadline when it goes idle at `from`: its idle timeout after that, never past its max
-- lifetime (`created`, `idle` and `lifetime` as the session hash holds them: seconds, numbers or strings).
local function idle_deadline(created, idle, lifetime, from)
  return math.min(tonumber(created) + tonumber(lifetime), from + tonumber(idle))
end
