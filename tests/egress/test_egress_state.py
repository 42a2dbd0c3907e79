"""`state/egress.py` against a real Redis: bindings (the lease and release scripts will mirror them) and metering."""

from __future__ import annotations

import time

from sandpool.state.egress import EgressBinding
from sandpool.state.keys import USAGE_DAY_RETENTION_DAYS, egress_digest, utc_day
from sandpool.state.usage import UsageStore

from .conftest import WORKSPACE, Egress


async def test_a_binding_reads_back_while_its_session_lives(egress: Egress) -> None:
    bound = await egress.bind_session(["files.example.org", "*.example.com:80"])
    found = await egress.store.binding(bound.credential)
    assert found == EgressBinding(session=bound.session, workspace=WORKSPACE,
                                  allow='["files.example.org","*.example.com:80"]')
    ttl = await egress.store.redis.ttl(egress.keys.egress_binding(bound.credential))
    assert 0 < ttl <= 7200
    assert await egress.store.binding(bound.credential + "x") is None


async def test_a_binding_carries_the_connection_cap_its_lease_recorded(egress: Egress) -> None:
    """The workspace's `max_egress_connections`, as the lease recorded it on the session, comes back with the
    binding (0: none of its own, the egress proxy's ceiling applies)."""
    capped = await egress.bind_session([], limits={"max_concurrent_sessions": 0, "max_egress_connections": 7})
    found = await egress.store.binding(capped.credential)
    assert found is not None and found.max_egress_connections == 7
    plain = await egress.bind_session([])
    found = await egress.store.binding(plain.credential)
    assert found is not None and found.max_egress_connections == 0


async def test_unbind_revokes_at_once_and_says_whether_it_did(egress: Egress) -> None:
    bound = await egress.bind_session(["files.example.org"])
    assert await egress.store.unbind(bound.credential) is True
    assert await egress.store.binding(bound.credential) is None
    assert await egress.store.unbind(bound.credential) is False


async def test_a_rebind_replaces_every_field(egress: Egress) -> None:
    bound = await egress.bind_session(["files.example.org"])
    key = egress.keys.egress_binding(bound.credential)
    await egress.store.redis.hset(key, "stray", "1")
    await egress.store.bind(bound.credential, session=bound.session, workspace=WORKSPACE, allow=[], ttl_seconds=60)
    assert await egress.store.redis.hgetall(key) == {"session": bound.session, "workspace": WORKSPACE, "allow": "[]"}
    assert (await egress.store.binding(bound.credential)).allow == "[]"  # type: ignore[union-attr]  # bound above: the binding exists


async def test_the_key_is_the_credentials_digest(egress: Egress) -> None:
    key = egress.keys.egress_binding("a-credential-of-some-length")
    assert key == egress.keys.egress_binding_prefix + egress_digest("a-credential-of-some-length")
    assert key.startswith("{" + egress.keys.prefix + "}:egress:")  # the installation's hash tag: one slot
    assert "a-credential" not in key


async def test_meter_writes_counters_and_one_event_in_one_step(egress: Egress) -> None:
    now = time.time()
    for bytes_in, bytes_out in ((1000, 200), (5, 7)):
        await egress.store.meter(workspace="ws-meter", session="se-1", bytes_in=bytes_in, bytes_out=bytes_out,
                                 now=now, host="files.example.org", port=443)
    total = await egress.store.redis.hgetall(egress.keys.usage_total("ws-meter"))
    assert total == {"egress_bytes": "1212", "egress_bytes_in": "1005", "egress_bytes_out": "207",
                     "egress_connections": "2"}
    day_key = egress.keys.usage_day("ws-meter", utc_day(now))
    assert await egress.store.redis.hgetall(day_key) == total
    assert 0 < await egress.store.redis.ttl(day_key) <= USAGE_DAY_RETENTION_DAYS * 86400
    assert await egress.store.redis.sismember(egress.keys.usage_workspaces, "ws-meter")
    events = [e for e in await egress.events() if e["workspace"] == "ws-meter"]
    assert events[0] == {"type": "egress", "workspace": "ws-meter", "ts": repr(now), "session": "se-1",
                         "host": "files.example.org", "port": "443", "egress_bytes": "1200", "egress_bytes_in": "1000",
                         "egress_bytes_out": "200"}
    assert len(events) == 2
    # the admin API's usage view reads the counters as numbers, like every other
    totals, days = await UsageStore(egress.store.redis, egress.keys).read("ws-meter", [utc_day(now)])
    assert totals["egress_bytes"] == 1212 and days[0]["counters"]["egress_connections"] == 2


async def test_the_ceiling_is_published_for_the_admin_api(egress: Egress) -> None:
    assert await egress.store.ceiling() is None
    await egress.store.publish_ceiling(["pypi.org", "*.example.com:8443"])
    assert await egress.store.ceiling() == ["pypi.org", "*.example.com:8443"]
    await egress.store.redis.set(egress.keys.egress_ceiling, "not json")
    assert await egress.store.ceiling() is None
