"""Bursts past the warm pool: callers below the ceiling wait for a sandbox started for them, 503 means full.

Real Redis, the real api beside the real controller (sharing only Redis), real local sandboxes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from sessions_harness import ServedApp
from testkit import descendants, wait_for

PRINT_1 = {"tool": "code_execution", "input": {"code": "print(1)"}}



POOL_SETTINGS = ("pool_size", "max_warm", "max_sandboxes", "image", "pools_file")
"""The settings both processes read (the api to lease within the ceiling, the controller to keep it warm)."""


@pytest.fixture
def pool(api: Callable[..., ServedApp], controller: Callable[..., ServedApp]) -> Callable[..., ServedApp]:
    """A standalone api beside a controller with local sandboxes, both ready before the api is returned."""

    def make(**settings: object) -> ServedApp:
        pools = {name: value for name, value in settings.items() if name in POOL_SETTINGS}
        ctl = controller(**pools)
        app = api(**{"capacity_wait_seconds": 30, **settings})
        wait_for(lambda: httpx.get(ctl.url + "/readyz").status_code == 200, timeout=30, what="controller ready")
        wait_for(lambda: httpx.get(app.url + "/readyz").status_code == 200, timeout=30, what="api ready")
        return app

    return make


async def burst(url: str, count: int, *, headers: dict[str, str] | None = None,
                timeout: float = 60) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, headers=headers) as client:
        return await asyncio.gather(*(client.post("/sessions", json={}) for _ in range(count)))


def ready(r, keys, pool: str = "default") -> int:  # type: ignore[no-untyped-def]  # r, keys: the suite's fixtures
    return int(r.llen(keys.pool_ready(pool)))


def no_waiters_left(r, keys, pool: str = "default") -> bool:  # type: ignore[no-untyped-def]  # as above
    return (r.scard(keys.pool_waiters(pool)) == 0 and r.scard(keys.pool_queued(pool)) == 0
            and not r.exists(keys.pool_wait_ring(pool)) and not list(r.scan_iter(keys.waiter_prefix + "*")))


def test_a_burst_of_20_on_a_warm_pool_of_2_below_the_ceiling_is_served_whole(pool, r, keys) -> None:
    app = pool(pool_size=2, max_sandboxes=32)
    wait_for(lambda: ready(r, keys) == 2, timeout=30, what="two warm sandboxes")
    answers = asyncio.run(burst(app.url, 20))
    assert [a.status_code for a in answers] == [201] * 20, [a.text for a in answers if a.status_code != 201]
    sessions = [a.json()["session_id"] for a in answers]
    sandboxes = {r.hget(keys.session(sid), "sandbox") for sid in sessions}
    assert len(sandboxes) == 20  # one sandbox per session, never shared
    with httpx.Client(base_url=app.url, timeout=60) as client:
        for sid in sessions:
            result = client.post(f"/sessions/{sid}/exec", json=PRINT_1).json()["result_block"]["content"]
            assert result["stdout"] == "1\n"
            assert client.delete(f"/sessions/{sid}").status_code == 204
    assert "capacity_refusals" not in r.hgetall(keys.usage_total("_standalone"))  # waiting is not a refusal
    assert no_waiters_left(r, keys)


def test_at_the_ceiling_503_at_capacity_comes_at_once(pool, r, keys) -> None:
    app = pool(pool_size=2, max_sandboxes=5)
    wait_for(lambda: ready(r, keys) == 2, timeout=30, what="two warm sandboxes")
    started = time.monotonic()
    answers = asyncio.run(burst(app.url, 20))
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [201] * 5 + [503] * 15
    refused = [a for a in answers if a.status_code == 503]
    assert all(a.json()["reason"] == "at_capacity" for a in refused)
    assert all(1 <= int(a.headers["retry-after"]) <= 60 for a in refused)
    # Refused at once, not after the capacity wait (30 s): the 5 granted needed starts, the 15 did not.
    assert time.monotonic() - started < 30
    total = r.hgetall(keys.usage_total("_standalone"))
    assert total["capacity_refusals"] == "15" and total["sessions_created"] == "5"
    assert no_waiters_left(r, keys)


def churn(url: str, sessions: int) -> None:
    """Sessions created and destroyed one after another: the pool's release rate."""
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(sessions):
            created = client.post("/sessions", json={})
            assert created.status_code == 201, created.text
            assert client.delete(f"/sessions/{created.json()['session_id']}").status_code == 204


def seed_releases(r, keys, releases: int, pool: str = "default") -> None:  # type: ignore[no-untyped-def]
    """As if `releases` sessions of the pool had been released in the current 10-second bucket (what
    the release script counts), for a release rate no test could churn through in its time."""
    from sandpool.state.sessions import rate_bucket

    key = keys.pool_rate_prefix(pool, "releases") + str(rate_bucket(time.time()))
    r.set(key, releases, ex=120)


def test_at_the_ceiling_a_churning_pool_queues_the_caller_for_the_next_release(pool, r, keys) -> None:
    app = pool(pool_size=1, max_sandboxes=2)
    churn(app.url, 8)  # 8 releases in the last minute: one slot frees every 7.5 s, within half the wait
    with httpx.Client(base_url=app.url, timeout=60) as client:
        held = [client.post("/sessions", json={}) for _ in range(2)]
        assert [h.status_code for h in held] == [201, 201]

        async def third() -> httpx.Response:
            async with httpx.AsyncClient(base_url=app.url, timeout=60) as other:
                return await other.post("/sessions", json={})

        async def scenario() -> httpx.Response:
            waiting = asyncio.ensure_future(third())
            deadline = time.monotonic() + 30
            while r.scard(keys.pool_waiters("default")) == 0:  # queued past the ceiling, not refused
                assert not waiting.done(), waiting.result().text
                assert time.monotonic() < deadline, "the third caller never queued"
                await asyncio.sleep(0.01)
            assert not waiting.done()
            freed = held[0].json()["session_id"]
            assert (await asyncio.to_thread(client.delete, f"/sessions/{freed}")).status_code == 204
            return await waiting

        answer = asyncio.run(scenario())
    assert answer.status_code == 201, answer.text
    sandboxes = {r.hget(keys.session(h.json()["session_id"]), "sandbox") for h in (held[1], answer)}
    assert len(sandboxes) == 2 and None not in sandboxes  # a fresh sandbox, not the released one's
    assert "capacity_refusals" not in r.hgetall(keys.usage_total("_standalone"))
    assert no_waiters_left(r, keys)


def test_at_the_ceiling_a_pool_releasing_too_slowly_for_the_wait_refuses_at_once(pool, r, keys) -> None:
    app = pool(pool_size=1, max_sandboxes=1)  # the wait is 30 s: one release every 15 s would do
    with httpx.Client(base_url=app.url, timeout=60) as client:
        held = client.post("/sessions", json={})
        assert held.status_code == 201
        seed_releases(r, keys, 3)  # one release every 20 s
        started = time.monotonic()
        refused = client.post("/sessions", json={})
        assert time.monotonic() - started < 15, "refused at once, not after a wait"
    assert refused.status_code == 503 and refused.json()["reason"] == "at_capacity", refused.text
    assert refused.headers["retry-after"] == "20"  # one release for it, at 3 a minute
    assert r.hgetall(keys.usage_total("_standalone"))["capacity_refusals"] == "1"
    assert no_waiters_left(r, keys)


def test_a_wait_past_the_ceiling_that_no_release_ends_is_503_at_capacity_soon(pool, r, keys) -> None:
    app = pool(pool_size=1, max_sandboxes=1)  # a capacity wait of 30 s
    with httpx.Client(base_url=app.url, timeout=60) as client:
        held = client.post("/sessions", json={})
        assert held.status_code == 201
        seed_releases(r, keys, 120)  # two a second: a slot should free in 0.5 s, but none does
        started = time.monotonic()
        answer = client.post("/sessions", json={})
        waited = time.monotonic() - started
        assert client.post(f"/sessions/{held.json()['session_id']}/exec", json=PRINT_1).status_code == 200
    assert answer.status_code == 503 and answer.json()["reason"] == "at_capacity", answer.text
    assert "retry-after" in answer.headers
    # It waited for a release (twice the expected 0.5 s), and gave up long before the capacity wait.
    assert 1 <= waited < 15, waited
    assert no_waiters_left(r, keys)
    refusals = [e for _, e in r.xrange(keys.usage_events) if e["type"] == "capacity_refusal"]
    assert [e["limit"] for e in refusals] == ["at_capacity"]
    assert r.hgetall(keys.usage_total("_standalone"))["capacity_refusals"] == "1"


def test_a_provider_that_cannot_start_gives_start_timeout_after_the_wait(api, controller, r, keys) -> None:
    from sandpool.providers.local.provider import LocalProvider
    from sandpool.providers.local.settings import LocalProviderSettings

    broken = LocalProvider(LocalProviderSettings(data_dir=controller.data_dir, launcher="subprocess",
                                                 agent_python="/nonexistent/python"))
    controller(provider=broken, pool_size=0, max_sandboxes=4)
    app = api(pool_size=0, max_sandboxes=4, capacity_wait_seconds=2)
    answer = httpx.post(app.url + "/sessions", json={}, timeout=30)
    assert answer.status_code == 503 and answer.json()["reason"] == "start_timeout", answer.text
    assert no_waiters_left(r, keys)
    assert r.get(keys.pool_last_error("default")), "the provider's last error is kept for the log"
    refusals = [e for _, e in r.xrange(keys.usage_events) if e["type"] == "capacity_refusal"]
    assert [e["limit"] for e in refusals] == ["start_timeout"]


def zygotes() -> set[int]:
    """The zygotes this test process runs (one per controller app; forked agents are not its children)."""
    found = set()
    for pid in descendants(os.getpid()):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid() and b"zygote_server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except OSError:  # it has just exited
            continue
    return found


def test_a_waiter_that_disconnects_leaks_nothing_and_its_sandbox_goes_to_the_pool(pool, r, keys) -> None:
    others = zygotes()  # of apps other fixtures of this run still serve
    app = pool(pool_size=0, max_sandboxes=3)
    # The caller must leave before its sandbox is ready, however fast sandboxes start on this machine:
    # the zygote that starts them is stopped until the api has seen the caller go.
    [zygote] = zygotes() - others
    host, port = app.url.removeprefix("http://").rsplit(":", 1)
    os.kill(zygote, signal.SIGSTOP)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as caller:
            caller.sendall(b"POST /sessions HTTP/1.1\r\nHost: sandpool\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 2\r\n\r\n{}")
            wait_for(lambda: r.scard(keys.pool_waiters("default")) == 1, timeout=10, interval=0.01,
                     what="the caller waiting")
        wait_for(lambda: no_waiters_left(r, keys), timeout=10, what="the waiter gone")
    finally:
        os.kill(zygote, signal.SIGCONT)
    # The sandbox started for it lands in the warm pool (nobody waits for it any more): no session, no
    # waiter, no promise left anywhere.
    wait_for(lambda: ready(r, keys) >= 1, timeout=30, what="its sandbox in the warm pool")
    assert not list(r.scan_iter(keys.session_prefix + "*"))
    states = {r.hget(keys.sandbox(s), "state") for s in r.smembers(keys.pool_members("default"))}
    assert "promised" not in states and "leased" not in states
    assert "sessions_created" not in r.hgetall(keys.usage_total("_standalone"))


def test_one_workspaces_burst_does_not_starve_another_asking_for_one(tenant_api, controller, r, keys) -> None:
    ctl = controller(pool_size=0, max_sandboxes=32)
    app = tenant_api(capacity_wait_seconds=60, pool_size=0, max_sandboxes=32)
    wait_for(lambda: httpx.get(ctl.url + "/readyz").status_code == 200, timeout=30, what="controller ready")
    bursty, quiet = app.headers("bursty", max_concurrent=20), app.headers("quiet")

    def created() -> list[str]:
        return [e["workspace"] for _, e in r.xrange(keys.usage_events) if e["type"] == "session_created"]

    async def until(check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    async def scenario() -> tuple[list[httpx.Response], httpx.Response, int]:
        bursting = asyncio.ensure_future(burst(app.url, 50, headers=bursty))
        # The burst's 20 admitted callers are waiting or served (30 are refused by its own quota),
        await until(lambda: r.scard(keys.pool_waiters("default")) + len(created()) >= 20, "the burst queued")
        async with httpx.AsyncClient(base_url=app.url, timeout=60) as client:
            lone = asyncio.ensure_future(client.post("/sessions", json={}, headers=quiet))
            # ... then the lone caller queues behind them: how many of them were served by then?
            await until(lambda: bool(r.exists(keys.pool_wait_queue("default", "quiet"))) or "quiet" in created(),
                        "the lone caller queued")
            served_before = len(created())
            return await bursting, await lone, served_before

    answers, lone, served_before = asyncio.run(scenario())
    assert lone.status_code == 201, lone.text
    assert sorted(a.status_code for a in answers) == [201] * 20 + [429] * 30  # its waiters count to its quota
    order = created()
    # Round-robin across workspaces: the lone caller, queued behind the other workspace's waiters,
    # is served with the next sandboxes started (after those already promised), not after the
    # whole burst. The bound counts from when it queued, whatever the machine's speed.
    assert order.index("quiet") < served_before + 12, (served_before, order)
    assert no_waiters_left(r, keys)


def test_the_warm_target_follows_demand_between_floor_and_cap(data_dir, redis_url, redis_prefix) -> None:
    """A steady 2-3 leases/s lifts the target above the floor; once it stops, the target comes back down."""
    from sandpool.controller.controller import PoolController
    from sandpool.controller.provider import PoolSpec
    from sandpool.providers import build_provider
    from sandpool.state import close, connect
    from sandpool.state.keys import Keys
    from sandpool.state.sessions import Leased, SessionLimits, SessionStore

    limits = SessionLimits(idle_timeout_seconds=60, max_lifetime_seconds=600, exec_timeout_seconds=30,
                           max_exec_timeout_seconds=30)

    async def scenario() -> tuple[list[tuple[int, float, float]], list[int]]:
        redis = connect(redis_url, timeout=5)
        keys = Keys(redis_prefix)
        provider = build_provider("local", None, data_dir=data_dir)
        await provider.start()
        spec = PoolSpec(name="default", image="python", warm=1, max_warm=6, ceiling=12)
        # A short test: the rate over 20 s instead of a minute and a quick shrink. The margin is
        # large enough that the target leaves the floor whatever this machine's start time (a
        # fast machine starts a sandbox in under 0.1 s), so the cap is what bounds it.
        controller = PoolController(redis, keys, provider, [spec], replica_id="test", demand_seconds=0.2,
                                    demand_window_buckets=2, demand_headroom=1000.0, demand_shrink_seconds=0.3)
        target = controller.targets["default"]
        running = asyncio.create_task(controller.run())
        store = SessionStore(redis, keys)
        rising: list[tuple[int, float, float]] = []  # (target, lease rate, start time estimate)
        falling: list[int] = []
        try:
            for n in range(12):  # ~2.5 sessions a second for 5 seconds
                lease = await store.lease(session_id=f"s{n}", workspace="w", pool="default", image="python",
                                          now=time.time(), limits=limits, workspace_limits={}, ceiling=12,
                                          wait_seconds=30)
                if not isinstance(lease, Leased):
                    for _ in range(300):
                        claimed = await store.claim(waiter=f"s{n}", workspace="w", pool="default", now=time.time())
                        if isinstance(claimed, Leased):
                            break
                        await asyncio.sleep(0.05)
                await store.release(session_id=f"s{n}", workspace="w", now=time.time(), mode="destroy")
                rising.append((target.target, round(target.lease_rate, 2), round(target.start_seconds, 2)))
                await asyncio.sleep(0.4)
            deadline = time.monotonic() + 40  # the leases age out of the two 10-second buckets
            while time.monotonic() < deadline and target.target > spec.warm:
                falling.append(target.target)
                await asyncio.sleep(0.5)
            falling.append(target.target)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await provider.destroy_all()
            await provider.close()
            await close(redis)
        return rising, falling

    rising, falling = asyncio.run(scenario())
    assert max(t for t, _, _ in rising) > 1, rising  # above the floor under load
    assert max(t for t, _, _ in rising) == 6, rising  # demand asks for more; the cap holds it
    assert falling[-1] == 1, falling  # back to the floor once the load stopped
