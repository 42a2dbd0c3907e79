"""CreateSession and DestroySession through the api against a real Redis: capacity, clamping, images,
quota, budget, tenancy refusals, reaping (by the controller's session reaper). No call here reaches an
agent, so the sandboxes are published records (the lease never contacts them)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from sessions_harness import publish
from testkit import free_port, wait_for

from sandpool.contract import tenancy
from sandpool.state.channels import LEASE_NUDGE_PREFIX
from sandpool.state.keys import Keys, utc_day


def usage_total(r: redis.Redis, keys: Keys, workspace: str = tenancy.STANDALONE_WORKSPACE) -> dict[str, str]:
    return r.hgetall(keys.usage_total(workspace))


def create(url: str, body: object = None, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + "/sessions", json=body, headers=headers, timeout=10)


def test_handle_reports_what_is_in_force(api, r, keys) -> None:
    app = api(max_idle_timeout_seconds=100, max_lifetime_seconds=200)
    sandbox = publish(r, keys)
    started = time.time()
    resp = create(app.url, {"idle_timeout_seconds": 10**6, "max_lifetime_seconds": 150})
    assert resp.status_code == 201, resp.text
    handle = resp.json()
    assert handle["idle_timeout_seconds"] == 100  # clamped, not refused
    assert handle["max_lifetime_seconds"] == 150  # below the ceiling: kept
    assert handle["image"] == "python" and handle["exec_timeout_seconds"] == 60
    assert started - 1 <= handle["created_at"] == handle["last_activity_at"] <= time.time() + 1
    assert resp.headers["x-request-id"]
    sid = handle["session_id"]
    session = r.hgetall(keys.session(sid))
    assert session["sandbox"] == sandbox and session["workspace"] == tenancy.STANDALONE_WORKSPACE
    assert r.hget(keys.sandbox(sandbox), "state") == "leased"
    assert r.hget(keys.sandbox(sandbox), "session") == sid
    # Due at the idle timeout once the api confirmed its answer (which may trail the answer).
    wait_for(lambda: float(r.zscore(keys.deadlines, sid) or 0) == pytest.approx(handle["created_at"] + 100, abs=0.01),
             timeout=10, what="the create's confirmation", state=lambda: r.zscore(keys.deadlines, sid))
    assert 150 < r.ttl(keys.session(sid)) <= 150 + 3600
    assert usage_total(r, keys)["sessions_created"] == "1"
    events = r.xrange(keys.usage_events)
    assert [e[1]["type"] for e in events] == ["session_created"]


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"idle_timeout_seconds": 0}', b'{"max_lifetime_seconds": "x"}',
                                  b'{"image": 5}', b"null"])
def test_malformed_create_is_422_and_leases_nothing(api, r, keys, body: bytes) -> None:
    app = api()
    sandbox = publish(r, keys)
    resp = httpx.post(app.url + "/sessions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert resp.json()["reason"] == "invalid_request"
    assert r.lrange(keys.pool_ready("default"), 0, -1) == [sandbox]
    assert r.zcard(keys.deadlines) == 0 and not usage_total(r, keys)


def test_create_without_a_body_uses_the_defaults(api, r, keys) -> None:
    app = api()
    publish(r, keys)
    resp = httpx.post(app.url + "/sessions")
    assert resp.status_code == 201
    assert resp.json()["idle_timeout_seconds"] == 300


def test_pool_of_n_under_concurrent_creates_gives_exactly_n(api, r, keys) -> None:
    app = api()  # capacity wait 0: fail fast, as an operator may choose
    published = {publish(r, keys) for _ in range(5)}
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: create(app.url), range(30)))
    granted = [a for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code != 201]
    assert len(granted) == 5
    # Nothing was released in the last minute: the estimate is the longest Retry-After.
    assert all(a.status_code == 503 and a.headers["retry-after"] == "60" and a.json()["reason"] == "at_capacity"
               for a in refused)
    leased = {r.hget(keys.session(a.json()["session_id"]), "sandbox") for a in granted}
    assert leased == published  # each sandbox exactly once
    assert usage_total(r, keys)["capacity_refusals"] == "25"
    assert usage_total(r, keys)["sessions_created"] == "5"


def test_image_hint_picks_the_pool_and_unknown_images_fall_back(api, r, keys, tmp_path: Path) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  - {name: py, image: python, warm: 1, ceiling: 2}\n"
                     "  - {name: node, image: 'node:20', warm: 1, ceiling: 2}\n")
    app = api(pools_file=pools)
    node = publish(r, keys, pool="node", image="node:20")
    py = publish(r, keys, pool="py", image="python")
    first = create(app.url, {"image": "node:20"})
    assert first.status_code == 201 and first.json()["image"] == "node:20" and first.json()["pool"] == "node"
    assert r.hget(keys.session(first.json()["session_id"]), "sandbox") == node
    second = create(app.url, {"image": "cobol:1"})
    assert second.status_code == 201 and second.json()["image"] == "python"
    assert r.hget(keys.session(second.json()["session_id"]), "sandbox") == py
    third = create(app.url, {"image": "node:20"})
    assert third.status_code == 503  # its pool is empty; no borrowing from another pool


def test_a_listed_sandbox_that_is_no_longer_ready_is_skipped(api, r, keys) -> None:
    app = api()
    stale = publish(r, keys)
    r.hset(keys.sandbox(stale), "state", "doomed")  # e.g. doomed by reconciliation while listed
    good = publish(r, keys)
    resp = create(app.url)
    assert resp.status_code == 201
    assert r.hget(keys.session(resp.json()["session_id"]), "sandbox") == good
    assert r.hget(keys.sandbox(stale), "state") == "doomed"


def test_a_ready_record_without_address_is_doomed_not_leased(api, r, keys) -> None:
    app = api()
    broken = publish(r, keys)
    r.hdel(keys.sandbox(broken), "address")
    assert create(app.url).status_code == 503
    assert r.hget(keys.sandbox(broken), "state") == "doomed" and r.sismember(keys.doomed, broken)
    good = publish(r, keys)
    resp = create(app.url)
    assert resp.status_code == 201 and r.hget(keys.session(resp.json()["session_id"]), "sandbox") == good


def test_destroy_releases_meters_and_dooms(api, r, keys) -> None:
    app = api()
    sandbox = publish(r, keys)
    pubsub = r.pubsub()
    pubsub.subscribe(keys.pool_events)
    wait_for(lambda: pubsub.get_message(timeout=0.1), timeout=10, what="subscribed")
    sid = create(app.url).json()["session_id"]
    resp = httpx.delete(f"{app.url}/sessions/{sid}")
    assert resp.status_code == 204 and resp.content == b""
    assert not r.exists(keys.session(sid)) and r.zscore(keys.deadlines, sid) is None
    assert r.hget(keys.sandbox(sandbox), "state") == "doomed" and r.sismember(keys.doomed, sandbox)
    assert not r.sismember(keys.workspace_sessions(tenancy.STANDALONE_WORKSPACE), sid)
    lease_nudge = wait_for(lambda: pubsub.get_message(timeout=0.1), timeout=10, what="the lease's nudge")
    assert lease_nudge["data"] == LEASE_NUDGE_PREFIX + sandbox  # the controller may act on it a little later
    release_nudge = wait_for(lambda: pubsub.get_message(timeout=0.1), timeout=10, what="the release's nudge")
    assert release_nudge["data"] == sandbox  # acted on at once: a slot is free
    seconds = float(usage_total(r, keys)["session_seconds"])
    assert 0 <= seconds < 5
    day = r.hgetall(keys.usage_day(tenancy.STANDALONE_WORKSPACE, utc_day(time.time())))
    assert float(day["session_seconds"]) == seconds and day["sessions_created"] == "1"
    assert 0 < r.ttl(keys.usage_day(tenancy.STANDALONE_WORKSPACE, utc_day(time.time())))
    released = [e[1] for e in r.xrange(keys.usage_events) if e[1]["type"] == "session_released"]
    assert released[0]["reason"] == "destroy" and float(released[0]["session_seconds"]) == seconds
    # Again, and an id that never existed: 204, nothing metered twice.
    assert httpx.delete(f"{app.url}/sessions/{sid}").status_code == 204
    assert httpx.delete(f"{app.url}/sessions/nope").status_code == 204
    assert httpx.delete(f"{app.url}/sessions/{'x' * 300}").status_code == 204
    assert float(usage_total(r, keys)["session_seconds"]) == seconds
    pubsub.close()


def test_idle_sessions_are_reaped(api, reaper, r, keys) -> None:
    app = api()
    sandbox = publish(r, keys)
    sid = create(app.url, {"idle_timeout_seconds": 1}).json()["session_id"]
    wait_for(lambda: not r.exists(keys.session(sid)), timeout=15, what="idle reap")
    assert r.hget(keys.sandbox(sandbox), "state") == "doomed"
    events = [e[1] for e in r.xrange(keys.usage_events) if e[1]["type"] == "session_released"]
    assert events[0]["reason"] == "idle" and float(events[0]["session_seconds"]) >= 1
    assert 'sandpool_sessions_reaped_total{reason="idle"} 1.0' in reaper.metrics_text()


def test_max_lifetime_reaps_even_an_active_session(api, reaper, r, keys) -> None:
    app = api()
    publish(r, keys)
    sid = create(app.url, {"idle_timeout_seconds": 100, "max_lifetime_seconds": 1}).json()["session_id"]
    # Calls keep it active but cannot extend it past its lifetime (the list call itself may
    # fail to reach the fake sandbox: either way it must not outlive its lifetime).
    wait_for(lambda: not r.exists(keys.session(sid)), timeout=15, what="lifetime reap")
    events = [e[1] for e in r.xrange(keys.usage_events) if e[1]["type"] == "session_released"]
    assert events[0]["reason"] == "lifetime"
    assert httpx.get(f"{app.url}/sessions/{sid}/files/list").status_code == 404


def test_concurrent_session_quota_is_exact_under_20_concurrent_creates(tenant_api, r, keys) -> None:
    app = tenant_api()
    for _ in range(25):
        publish(r, keys)
    headers = app.headers("acme", max_concurrent=5)
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: create(app.url, headers=headers), range(20)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [201] * 5 + [429] * 15
    for a in answers:
        if a.status_code == 429:
            assert a.json()["limit"] == "max_concurrent_sessions" and int(a.headers["retry-after"]) >= 1
    assert r.scard(keys.workspace_sessions("acme")) == 5
    assert r.hget(keys.usage_total("acme"), "quota_refusals") == "15"
    assert r.llen(keys.pool_ready("default")) == 20
    # Another workspace is not affected, and a release frees a slot.
    assert create(app.url, headers=app.headers("other", max_concurrent=5)).status_code == 201
    first = next(a.json()["session_id"] for a in answers if a.status_code == 201)
    assert httpx.delete(f"{app.url}/sessions/{first}", headers=headers).status_code == 204
    assert create(app.url, headers=headers).status_code == 201
    assert create(app.url, headers=headers).status_code == 429


def test_daily_budget_refuses_once_spent(tenant_api, r, keys) -> None:
    app = tenant_api()
    for _ in range(3):
        publish(r, keys)
    headers = app.headers("acme", budget=1)
    sid = create(app.url, headers=headers).json()["session_id"]
    created = float(r.hget(keys.session(sid), "created_at"))
    wait_for(lambda: time.time() > created + 1.05, timeout=10, what="a second of session time")
    # The live session has used the budget already.
    refused = create(app.url, headers=headers)
    assert refused.status_code == 429 and refused.json()["limit"] == "daily_session_seconds_budget"
    assert int(refused.headers["retry-after"]) >= 1
    assert httpx.delete(f"{app.url}/sessions/{sid}", headers=headers).status_code == 204
    assert create(app.url, headers=headers).status_code == 429  # released: metered into today
    app.set_policy("acme")  # the admin drops the budget: none applies
    assert create(app.url, headers=headers).status_code == 201
    assert r.hget(keys.usage_total("acme"), "quota_refusals") == "2"


CONTRACT_CALLS = [("POST", "/sessions"), ("DELETE", "/sessions/abc"), ("POST", "/sessions/abc/exec"),
                  ("GET", "/sessions/abc"), ("GET", "/sessions/abc/files/list"), ("GET", "/sessions/abc/files?path=a"),
                  ("POST", "/sessions/abc/files"), ("DELETE", "/sessions/abc/exec")]


@pytest.mark.parametrize("auth", ["none", "wrong", "basic", "untrusted", "headers-only"])
def test_multi_tenant_refuses_a_caller_without_a_valid_token(tenant_api, r, keys, tmp_path, auth) -> None:
    """No token, a malformed one, a valid token sent as Basic, a token of a key the api does not trust,
    or only the X-Sandpool-* headers the retired proxy used to inject: 401 on every operation, nothing
    leased, nothing metered."""
    from sandpool.edge.keys_cli import generate_keypair, mint_token

    app = tenant_api()
    publish(r, keys)
    untrusted, _ = generate_keypair(tmp_path / "untrusted" / "key.pem")
    injected = {tenancy.WORKSPACE: "acme", "X-Sandpool-Max-Concurrent-Sessions": "0"}
    headers = {"none": {}, "wrong": {"Authorization": "Bearer wrong-credential-000000000000"},
               "basic": {"Authorization": f"Basic {app.token('acme')}"},
               "untrusted": {"Authorization": f"Bearer {mint_token(untrusted, 'acme')}"},
               "headers-only": injected}[auth]
    for method, path in CONTRACT_CALLS:
        resp = httpx.request(method, app.url + path, headers=headers)
        assert resp.status_code == 401, (method, path, resp.text)
        assert resp.headers["www-authenticate"].startswith("Bearer")
    assert r.llen(keys.pool_ready("default")) == 1 and r.zcard(keys.deadlines) == 0
    assert not r.exists(keys.usage_total("acme"))


def test_inbound_tenancy_headers_change_neither_the_workspace_nor_its_limits(tenant_api, r, keys) -> None:
    """The workspace is the token's and the limits are its stored policy's: X-Sandpool-* headers a
    client sends (the ones the proxy once injected) are read by nothing."""
    app = tenant_api()
    for _ in range(3):
        publish(r, keys)
    spoof = {tenancy.WORKSPACE: "victim", "X-Sandpool-Max-Concurrent-Sessions": "100",
             "X-Sandpool-Max-Idle-Timeout-Seconds": "100000", "X-Sandpool-Egress-Allow": "evil.example"}
    headers = app.headers("acme", max_concurrent=1, max_idle=30) | spoof
    first = create(app.url, {"idle_timeout_seconds": 1000}, headers=headers)
    assert first.status_code == 201, first.text
    assert first.json()["idle_timeout_seconds"] == 30
    session = r.hgetall(keys.session(first.json()["session_id"]))
    assert session["workspace"] == "acme"
    assert "evil.example" not in str(session)
    second = create(app.url, headers=headers)
    assert second.status_code == 429 and second.json()["limit"] == "max_concurrent_sessions"
    assert not r.exists(keys.workspace_sessions("victim")) and not r.exists(keys.usage_total("victim"))


@pytest.mark.parametrize(("mode", "message"), [({}, "no mode"),
                                               ({"auth": False, "trusted": True}, "exclude each other")])
def test_an_api_without_a_clear_mode_refuses_to_start(redis_url, redis_prefix, signing_key, mode, message) -> None:
    from sandpool.api.app import create_app
    from sandpool.api.settings import ApiSettings
    from sandpool.core.settings import ConfigurationError

    values = {"redis_url": redis_url, "redis_prefix": redis_prefix, "auth": mode.get("auth", True)}
    if mode.get("trusted"):
        values["auth_public_keys"] = [str(signing_key[1])]
    with pytest.raises(ConfigurationError, match=message):
        create_app(ApiSettings(**values))


def test_health_readiness_and_metrics(api, r, keys) -> None:
    app = api()
    publish(r, keys)
    publish(r, keys)
    assert httpx.get(app.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(app.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"redis": "ok"}
    assert create(app.url).status_code == 201
    text = httpx.get(app.url + "/metrics").text
    assert 'sandpool_leases_total{outcome="granted"} 1.0' in text
    assert 'sandpool_requests_total{operation="CreateSession",service="api",status="201"} 1.0' in text
    assert "sandpool_pool_sandboxes" not in text  # the pools' gauges are the controller's


def test_request_id_is_accepted_or_generated(api) -> None:
    app = api()
    assert httpx.get(app.url + "/healthz", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
    generated = httpx.get(app.url + "/healthz", headers={"X-Request-Id": "bad id!"}).headers["x-request-id"]
    assert generated != "bad id!" and len(generated) == 32


def test_redis_down_is_503_not_500(api, redis_prefix) -> None:
    app = api(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_seconds=0.5)
    resp = create(app.url)
    assert resp.status_code == 503 and resp.json()["reason"] == "redis_unavailable"
    assert httpx.get(app.url + "/readyz").status_code == 503
    assert json.loads(httpx.get(app.url + "/readyz").text)["checks"]["redis"] == "unreachable"


# Holds Redis busy (a script that spins on TIME) for about this long: commands sent meanwhile queue.
BUSY_SCRIPT = """local s = redis.call('TIME') local t = s
repeat t = redis.call('TIME') until (t[1] - s[1]) * 1000000 + (t[2] - s[2]) > tonumber(ARGV[1])
return 1"""


def test_a_lease_redis_runs_after_the_caller_gave_up_is_released(api, r, keys, redis_url) -> None:
    """A slow Redis (not a down one) still runs a lease whose caller timed out and answered 503:
    the api releases that session once Redis answers, not at its idle timeout (1 h here)."""
    app = api(redis_timeout_seconds=0.3, default_idle_timeout_seconds=3600)
    assert create(app.url).status_code == 503  # nothing to lease yet (and a Redis connection is pooled)
    sandbox = publish(r, keys)
    blocker = redis.Redis.from_url(redis_url)
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(blocker.eval, BUSY_SCRIPT, 0, 1_500_000)
        time.sleep(0.2)  # the script has reached Redis first: the lease below queues behind it
        resp = create(app.url)
        assert busy.result() == 1
    blocker.close()
    assert resp.status_code == 503 and resp.json()["reason"] == "redis_unavailable", resp.text

    def events() -> list[dict[str, str]]:
        return [f for _, f in r.xrange(keys.usage_events, "-", "+")]

    created = [e["session"] for e in events() if e["type"] == "session_created"]
    assert len(created) == 1, "the lease sent before the timeout ran once Redis was free"
    wait_for(lambda: r.sismember(keys.doomed, sandbox), timeout=10, what="the orphan released")
    released = [e for e in events() if e["type"] == "session_released"]
    assert [(e["session"], e["reason"]) for e in released] == [(created[0], "abandoned")]
    assert not r.exists(keys.session(created[0])) and r.zscore(keys.deadlines, created[0]) is None
    assert "sandpool_sessions_reaped_total{reason=\"abandoned\"} 1.0" in httpx.get(app.url + "/metrics").text


def test_capacity_wait_takes_a_sandbox_that_becomes_ready(api, r, keys) -> None:
    app = api(capacity_wait_seconds=10)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(create, app.url)
        time.sleep(0.3)  # the create is waiting (nothing is ready yet)
        assert not pending.done()
        sandbox = publish(r, keys)
        resp = pending.result()
    assert resp.status_code == 201
    assert r.hget(keys.session(resp.json()["session_id"]), "sandbox") == sandbox
    assert "capacity_refusals" not in usage_total(r, keys)  # waiting is not a refusal


def test_capacity_wait_ends_in_503_start_timeout_and_leaves_no_waiter(api, r, keys) -> None:
    app = api(capacity_wait_seconds=0.3)  # no controller: nothing is ever started for the waiter
    resp = create(app.url)
    assert resp.status_code == 503 and resp.json()["reason"] == "start_timeout", resp.text
    assert resp.headers["retry-after"] == "1"
    assert usage_total(r, keys)["capacity_refusals"] == "1"  # counted once, at the end
    refusals = [e for _, e in r.xrange(keys.usage_events) if e["type"] == "capacity_refusal"]
    assert [e["limit"] for e in refusals] == ["start_timeout"]
    assert r.scard(keys.pool_waiters("default")) == r.scard(keys.pool_queued("default")) == 0
    assert not r.exists(keys.pool_wait_ring("default"))


def test_workspace_maxima_lower_the_ceilings_a_hint_may_not_raise(tenant_api, r, keys) -> None:
    app = tenant_api(max_idle_timeout_seconds=600)
    publish(r, keys)
    publish(r, keys)
    headers = app.headers("acme", max_idle=50, max_lifetime=70, max_exec=2)
    handle = create(app.url, {"idle_timeout_seconds": 1000, "max_lifetime_seconds": 10**6}, headers=headers).json()
    assert (handle["idle_timeout_seconds"], handle["max_lifetime_seconds"]) == (50, 70)
    assert (handle["exec_timeout_seconds"], handle["max_exec_timeout_seconds"]) == (2, 2)
    session = r.hgetall(keys.session(handle["session_id"]))
    assert (session["idle_timeout_seconds"], session["max_lifetime_seconds"], session["workspace"]) == (
        "50", "70", "acme")
    # A workspace maximum above the operator's ceiling (stored before the ceiling was lowered) changes nothing.
    app.set_policy("acme", max_idle=10**5)
    roomy = create(app.url, {"idle_timeout_seconds": 10**5}, headers=headers).json()
    assert roomy["idle_timeout_seconds"] == 600


def test_a_lease_nudges_the_pool_controller(api, r, keys) -> None:
    """The refill starts when a sandbox is leased, not at the controller's next tick."""
    app = api()
    sandbox = publish(r, keys)
    nudges = r.pubsub(ignore_subscribe_messages=True)
    nudges.subscribe(keys.pool_events)
    try:
        assert nudges.get_message(timeout=1.0) is None  # the subscribe confirmation is ignored
        assert create(app.url).status_code == 201
        message = nudges.get_message(timeout=5.0)
        assert message is not None and message["data"] == LEASE_NUDGE_PREFIX + sandbox
        assert create(app.url).status_code == 503  # a refusal leases nothing and nudges no one
        assert nudges.get_message(timeout=0.5) is None
    finally:
        nudges.close()
