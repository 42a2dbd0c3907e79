"""The pool controller's atomic Redis steps, as Lua scripts.

Each script is one step of the sandbox lifecycle in `docs/architecture.md`; a
crash between two scripts leaves a state that reconciliation recognises
(`starting` too long, a member the provider does not run, a sandbox Redis does
not know). Every key a script touches is passed in KEYS or built inside the
script from a prefix passed in ARGV; all of them carry the installation's hash
tag, so each script touches one cluster slot.
"""

from __future__ import annotations

from typing import Any

# KEYS[1] sandbox hash, KEYS[2] pool members set
# ARGV: sandbox_id, ceiling, pool, image, created_at, owner, record_ttl_ms
# -> 1 registered (state=starting), 0 the pool is at its ceiling.
REGISTER_STARTING = """
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'starting', 'pool', ARGV[3], 'image', ARGV[4],
           'created_at', ARGV[5], 'owner', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS[1] sandbox hash, KEYS[2] pool ready list, KEYS[3] pool members set
# ARGV: sandbox_id, address, secret, ready_at, record_ttl_ms
# -> 1 published; 0 the record is no longer `starting` (forgotten or doomed meanwhile):
#    the caller must destroy what it created, nobody else will lease it.
PUBLISH_READY = """
if redis.call('HGET', KEYS[1], 'state') ~= 'starting'
   or redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'ready', 'address', ARGV[2], 'secret', ARGV[3],
           'ready_at', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
"""

# KEYS[1] sandbox hash, KEYS[2] pool members set, KEYS[3] pool ready list, KEYS[4] doomed set
# ARGV: sandbox_id
# Drops every trace of a sandbox the provider no longer runs.
FORGET = """
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('LREM', KEYS[3], 0, ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
return 1
"""

# KEYS[1] pool ready list, KEYS[2] doomed set
# ARGV: sandbox key prefix, how many
# -> how many ready sandboxes were doomed. The newest go (leases take the oldest); a listed id
#    that is no longer `ready` is only dropped from the list. Atomic with the lease script.
RETIRE_SURPLUS = """
local retired = 0
for _ = 1, tonumber(ARGV[2]) do
  local id = redis.call('RPOP', KEYS[1])
  if not id then break end
  local key = ARGV[1] .. id
  if redis.call('HGET', key, 'state') == 'ready' then
    redis.call('HSET', key, 'state', 'doomed')
    redis.call('SADD', KEYS[2], id)
    retired = retired + 1
  end
end
return retired
"""

# Leader lease: compare-and-renew and compare-and-release of `keys.controller_leader`.
# KEYS[1] leader key; ARGV: replica_id, lease_ms -> 1 still ours, 0 lost.
RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS[1] leader key; ARGV: replica_id -> 1 released, 0 it was not ours.
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Scripts:
    """The controller's scripts registered on one Redis client (EVALSHA with EVAL fallback)."""

    def __init__(self, redis: Any) -> None:
        self.register_starting = redis.register_script(REGISTER_STARTING)
        self.publish_ready = redis.register_script(PUBLISH_READY)
        self.forget = redis.register_script(FORGET)
        self.retire_surplus = redis.register_script(RETIRE_SURPLUS)
        self.renew_lease = redis.register_script(RENEW_LEASE)
        self.release_lease = redis.register_script(RELEASE_LEASE)
