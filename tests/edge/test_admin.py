"""The admin API: policy within ceilings, image allow-list before any lease, usage and sessions per workspace,
revocation that beats the verification cache."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from typing import Any

import redis
from testkit import keys_under

from sandpool.state import usage
from sandpool.state.keys import Keys as RedisKeys

from .conftest import Api, Keys
from .stack import Sandboxes


def test_policy_put_replaces_whole_and_get_shows_effective(make_api: Callable[..., Api], keys: Keys,
                                                          rdb: redis.Redis, redis_prefix: str) -> None:
    api = make_api(ceiling_requests_per_minute=600, max_lifetime_seconds=3600, max_idle_timeout_seconds=1800)
    with api.client(keys.token("ops", admin=True)) as admin:
        first = admin.put("/v1/workspaces/acme/policy", json={"allowed_images": ["python"],
                                                              "max_lifetime_seconds": 600,
                                                              "max_concurrent_sessions": 4})
        assert first.status_code == 200, first.text
        second = admin.put("/v1/workspaces/acme/policy", json={"requests_per_minute": 100})
        got = admin.get("/v1/workspaces/acme/policy").json()
    assert second.json() == got
    assert got["policy"]["allowed_images"] is None and got["policy"]["max_lifetime_seconds"] is None  # replaced
    # In force: what the api's own settings say (its 300 s exec ceiling, not "0").
    assert got["effective"]["limits"] == {"max_concurrent_sessions": 0, "max_idle_timeout_seconds": 1800,
                                          "max_lifetime_seconds": 3600, "max_exec_timeout_seconds": 300,
                                          "daily_session_seconds_budget": 0, "requests_per_minute": 100,
                                          "max_egress_connections": 0}
    assert got["ceilings"]["max_lifetime_seconds"] == 3600 and got["ceilings"]["requests_per_minute"] == 600
    stored = json.loads(rdb.get(RedisKeys(redis_prefix).workspace_policy("acme")))
    assert stored["requests_per_minute"] == 100


def test_policy_above_ceiling_or_malformed_is_422_and_keeps_the_old_one(make_api: Callable[..., Api],
                                                                        keys: Keys, rdb: redis.Redis,
                                                                        redis_prefix: str) -> None:
    api = make_api(workspace_max_concurrent_sessions=10, workspace_daily_session_seconds_budget=3600)
    key = RedisKeys(redis_prefix).workspace_policy("acme")
    with api.client(keys.token("ops", admin=True)) as admin:
        assert admin.put("/v1/workspaces/acme/policy", json={"max_concurrent_sessions": 5}).status_code == 200
        before = rdb.get(key)
        bad = [{"max_concurrent_sessions": 11},
               {"daily_session_seconds_budget": 3601, "max_concurrent_sessions": 1},
               {"max_concurrent_sessions": 0},
               {"max_concurrent_sessions": -1},
               {"max_concurrent_sessions": "lots"},
               {"unknown_field": 1},
               {"allowed_images": "python"},
               {"allowed_images": [""]}]
        for body in bad:
            response = admin.put("/v1/workspaces/acme/policy", json=body)
            assert response.status_code == 422, (body, response.text)
            assert response.json()["reason"] == "invalid_request"
        over = admin.put("/v1/workspaces/acme/policy", json={"max_concurrent_sessions": 11}).json()
        assert "ceiling 10" in over["detail"] and over["fields"] == ["max_concurrent_sessions"]
        not_json = admin.put("/v1/workspaces/acme/policy", content=b"{nope",
                             headers={"content-type": "application/json"})
        assert not_json.status_code == 422
        assert admin.put("/v1/workspaces/bad..name!/policy", json={}).status_code == 422
    assert rdb.get(key) == before


def test_images_outside_the_allow_list_are_403_before_any_lease(api: Api, keys: Keys, sandboxes: Sandboxes,
                                                                rdb: redis.Redis, redis_prefix: str) -> None:
    rkeys = RedisKeys(redis_prefix)
    for _ in range(3):
        sandboxes.publish()
    with api.client(keys.token("ops", admin=True)) as admin:
        assert admin.put("/v1/workspaces/acme/policy", json={"allowed_images": ["python", "node"]}).status_code == 200
    with api.client(keys.token("acme")) as client:
        refused = client.post("/sessions", json={"image": "ubuntu-with-tools"})
        not_a_string = client.post("/sessions", json={"image": ["python"]})
        not_json = client.post("/sessions", content=b"image=python")
        repeated = client.post("/sessions", content=b'{"image": "ubuntu-with-tools", "image": "python"}')
        assert sandboxes.ready() == 3  # every refusal came before a lease
        assert rdb.exists(rkeys.usage_total("acme")) == 0  # and nothing was metered
        allowed = client.post("/sessions", json={"image": "node", "idle_timeout_seconds": 5})
        default = client.post("/sessions")
    assert refused.status_code == 403 and refused.json()["reason"] == "image_not_allowed"
    assert refused.json()["allowed_images"] == ["node", "python"]
    assert not_a_string.status_code == 422 and not_json.status_code == 422
    assert repeated.status_code == 422 and "repeats" in repeated.json()["detail"]
    assert allowed.status_code == 201 and default.status_code == 201
    assert allowed.json()["idle_timeout_seconds"] == 5  # the body the edge read still reached the lease
    assert sandboxes.ready() == 1
    with api.client(keys.token("other")) as client:  # another workspace has no allow-list
        assert client.post("/sessions", json={"image": "ubuntu-with-tools"}).status_code == 201


def test_workspace_tokens_read_only_their_own(api: Api, keys: Keys) -> None:
    with api.client(keys.token("acme")) as client:
        assert client.get("/v1/usage").json()["workspace"] == "acme"
        assert client.get("/v1/usage", params={"workspace": "acme"}).status_code == 200
        assert client.get("/v1/sessions").json() == {"workspace": "acme", "sessions": []}
        for method, path, kwargs in [("GET", "/v1/usage?workspace=globex", {}),
                                     ("GET", "/v1/sessions?workspace=globex", {}),
                                     ("GET", "/v1/workspaces/globex/policy", {}),
                                     ("GET", "/v1/workspaces/acme/policy", {}),
                                     ("PUT", "/v1/workspaces/acme/policy", {"json": {}}),
                                     ("POST", "/v1/revocations", {"json": {"jti": "x", "ttl": 5}})]:
            response = client.request(method, path, **kwargs)
            assert response.status_code == 403, (path, response.text)
            assert response.json()["reason"] == "forbidden"
    with api.client(keys.token("ops", admin=True)) as admin:
        assert admin.get("/v1/usage", params={"workspace": "globex"}).json()["workspace"] == "globex"
        assert admin.get("/v1/sessions", params={"workspace": "globex"}).status_code == 200
        assert admin.get("/v1/workspaces/globex/policy").status_code == 200
        assert admin.get("/v1/usage", params={"workspace": "../x"}).status_code == 422


USAGE_COUNTERS = ("sessions_created", "session_seconds", "executions", "execution_seconds", "bytes_uploaded",
                  "bytes_downloaded", "capacity_refusals", "quota_refusals", "egress_bytes", "egress_bytes_in",
                  "egress_bytes_out", "egress_connections", "unconfirmed_executions")
"""The usage shape a billing consumer reads (docs/api.md), spelled out so a rename fails here."""


def zero_usage() -> dict[str, Any]:
    """A usage answer's counters when nothing happened: every counter and every built-in tool kind at 0."""
    return {**{name: 0 for name in USAGE_COUNTERS},
            "by_tool": {tool: {"executions": 0, "execution_seconds": 0}
                        for tool in ("code_execution", "bash_code_execution", "text_editor_code_execution")}}


def test_usage_totals_and_days_read_what_the_session_layer_wrote(api: Api, keys: Keys, rdb: redis.Redis,
                                                             redis_prefix: str) -> None:
    k = RedisKeys(redis_prefix)
    rdb.hset(k.usage_total("acme"), mapping={usage.SESSIONS_CREATED: 7, usage.SESSION_SECONDS: "123.5",
                                             usage.EXECUTIONS: 41, usage.EXECUTION_SECONDS: "2.5",
                                             "executions:code_execution": 40, "execution_seconds:code_execution": "2",
                                             "executions:bash_code_execution": 1,
                                             "execution_seconds:bash_code_execution": "0.5"})
    rdb.hset(k.usage_day("acme", "2026-11-30"), mapping={usage.SESSIONS_CREATED: 3})
    rdb.hset(k.usage_day("acme", "2026-12-01"), mapping={usage.SESSIONS_CREATED: 4, usage.BYTES_UPLOADED: 10})
    rdb.hset(k.usage_total("globex"), mapping={usage.SESSIONS_CREATED: 99})
    with api.client(keys.token("acme")) as client:
        plain = client.get("/v1/usage").json()
        ranged = client.get("/v1/usage", params={"from": "2026-11-29", "to": "2026-12-01"}).json()
        too_long = client.get("/v1/usage", params={"from": "2020-01-01", "to": "2026-12-01"})
        reversed_range = client.get("/v1/usage", params={"from": "2026-12-02", "to": "2026-12-01"})
        not_a_date = client.get("/v1/usage", params={"from": "yesterday"})
        only_from = client.get("/v1/usage", params={"from": dt.datetime.now(dt.UTC).date().isoformat()})
    empty = zero_usage()
    assert plain == {"workspace": "acme", "days": [], "total": {
        **empty, "sessions_created": 7, "session_seconds": 123.5, "executions": 41, "execution_seconds": 2.5,
        "by_tool": {**empty["by_tool"], "code_execution": {"executions": 40, "execution_seconds": 2},
                    "bash_code_execution": {"executions": 1, "execution_seconds": 0.5}}}}
    assert ranged["days"] == [{"day": "2026-11-29", "counters": empty},
                              {"day": "2026-11-30", "counters": {**empty, "sessions_created": 3}},
                              {"day": "2026-12-01", "counters": {**empty, "sessions_created": 4, "bytes_uploaded": 10}}]
    for response in (too_long, reversed_range, not_a_date):
        assert response.status_code == 422, response.text
    assert len(only_from.json()["days"]) == 1


def test_a_fresh_workspace_reads_every_counter_at_zero(api: Api, keys: Keys) -> None:
    zeros = zero_usage()
    with api.client(keys.token("fresh")) as client:
        answer = client.get("/v1/usage", params={"from": "2026-11-30", "to": "2026-12-01"}).json()
    assert answer == {"workspace": "fresh", "total": zeros,
                      "days": [{"day": "2026-11-30", "counters": zeros}, {"day": "2026-12-01", "counters": zeros}]}


def test_sessions_list_never_shows_secret_or_address(api: Api, keys: Keys, rdb: redis.Redis,
                                                     redis_prefix: str) -> None:
    k = RedisKeys(redis_prefix)
    now = time.time()
    for sid, ws in [("s-a1", "acme"), ("s-a2", "acme"), ("s-g1", "globex")]:
        rdb.hset(k.session(sid), mapping={"sandbox": "sb-" + sid, "pool": "python", "image": "python",
                                          "workspace": ws, "address": "unix:///tmp/agent.sock",
                                          "secret": "agent-secret-" + sid, "created_at": now,
                                          "last_activity_at": now, "idle_timeout_seconds": 300,
                                          "max_lifetime_seconds": 3600, "exec_timeout_seconds": 60})
        rdb.sadd(k.workspace_sessions(ws), sid)
        rdb.zadd(k.deadlines, {sid: now + 300})
    rdb.sadd(k.workspace_sessions("acme"), "s-gone", "s-g1")  # stale member; and one not acme's
    with api.client(keys.token("acme")) as client:
        response = client.get("/v1/sessions")
    assert response.status_code == 200
    listed = response.json()["sessions"]
    assert [s["session_id"] for s in listed] == ["s-a1", "s-a2"]
    assert listed[0]["deadline"] == now + 300 and listed[0]["idle_timeout_seconds"] == 300
    assert "secret" not in response.text and "agent.sock" not in response.text and "address" not in response.text


def test_revocation_applies_even_to_a_cached_token(api: Api, keys: Keys, sandboxes: Sandboxes, rdb: redis.Redis,
                                                   redis_prefix: str) -> None:
    for _ in range(3):
        sandboxes.publish()
    victim = keys.token("acme", jti="stolen-1", ttl_seconds=600)
    with api.client(victim) as client:
        assert client.post("/sessions", json={}).status_code == 201  # verified and cached
        with api.client(keys.token("ops", admin=True)) as admin:
            bad = admin.post("/v1/revocations", json={"jti": "stolen-1"})
            both = admin.post("/v1/revocations", json={"jti": "stolen-1", "ttl": 5, "exp": 5})
            revoked = admin.post("/v1/revocations", json={"jti": "stolen-1", "exp": int(time.time()) + 600})
        assert bad.status_code == 422 and both.status_code == 422
        assert revoked.status_code == 201
        response = client.post("/sessions", json={})
        admin_api = client.get("/v1/usage")
    assert response.status_code == 401 and response.json()["cause"] == "revoked"
    assert response.headers["www-authenticate"] == "Bearer"
    assert admin_api.status_code == 401
    assert sandboxes.ready() == 2  # the revoked token leased nothing
    ttl = rdb.ttl(RedisKeys(redis_prefix).revoked("stolen-1"))
    assert 600 < ttl <= 600 + api.settings.auth_leeway_seconds  # kept until the token would have expired
    with api.client(keys.token("acme", jti="other")) as client:  # other tokens of the workspace still work
        assert client.post("/sessions", json={}).status_code == 201


def test_revoked_admin_token_stops_at_once(api: Api, keys: Keys, rdb: redis.Redis, redis_prefix: str) -> None:
    before = set(keys_under(rdb, redis_prefix))
    admin_token = keys.token("ops", admin=True, jti="admin-1")
    with api.client(admin_token) as admin:
        assert admin.get("/v1/workspaces/acme/policy").status_code == 200
        assert admin.post("/v1/revocations", json={"jti": "admin-1", "ttl": 60}).status_code == 201
        assert admin.put("/v1/workspaces/acme/policy", json={"requests_per_minute": 1}).status_code == 401
    assert set(keys_under(rdb, redis_prefix)) - before == {RedisKeys(redis_prefix).revoked("admin-1")}


def test_openapi_documents_the_admin_api(api: Api) -> None:
    spec = api.client().get("/openapi.json").json()
    for path in ("/v1/usage", "/v1/sessions", "/v1/workspaces/{workspace}/policy", "/v1/revocations", "/sessions",
                 "/sessions/{session_id}/exec"):
        assert path in spec["paths"], path
    assert "Policy" in spec["components"]["schemas"] and "RevocationRequest" in spec["components"]["schemas"]
