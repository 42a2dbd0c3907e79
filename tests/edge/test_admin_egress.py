"""The workspace policy's egress allow-list: validated by the egress proxy's parser, bounded by the ceiling the
egress proxy published, bound by the lease to the new session's sandbox's egress credential (what the egress
proxy reads), and set from `sandpool admin` as a list."""

from __future__ import annotations

import json

import pytest
import redis

from sandpool.client.admin_cli import parse_changes, show_policy
from sandpool.state.keys import Keys as RedisKeys

from .conftest import Api, Keys
from .stack import Sandboxes


def publish_egress_ceiling(rdb: redis.Redis, prefix: str, entries: list[str]) -> None:
    """What `sandpool egress` publishes at start."""
    rdb.set(RedisKeys(prefix).egress_ceiling, json.dumps(entries))


def bound_allow_list(api: Api, keys: Keys, sandboxes: Sandboxes, rdb: redis.Redis, prefix: str,
                     workspace: str) -> list[str]:
    """Create a session of `workspace` on a sandbox with an egress credential; the allow-list the lease
    bound to that credential, as the egress proxy reads it."""
    credential = f"egress-credential-{workspace}"
    sandboxes.publish(egress=credential)
    with api.client(keys.token(workspace)) as client:
        created = client.post("/sessions", json={})
    assert created.status_code == 201, created.text
    binding = rdb.hgetall(RedisKeys(prefix).egress_binding(credential))
    assert binding["session"] == created.json()["session_id"] and binding["workspace"] == workspace
    return json.loads(binding["allow"])


def test_an_allow_list_within_the_ceiling_is_stored_shown_and_bound_to_the_session(
        api: Api, keys: Keys, rdb: redis.Redis, redis_prefix: str, sandboxes: Sandboxes) -> None:
    publish_egress_ceiling(rdb, redis_prefix, ["pypi.org", "files.pythonhosted.org", "*.example.com"])
    with api.client(keys.token("ops", admin=True)) as admin:
        put = admin.put("/v1/workspaces/acme/policy",
                        json={"egress_allow": ["pypi.org", "files.pythonhosted.org", "api.example.com"]})
        assert put.status_code == 200, put.text
        got = admin.get("/v1/workspaces/acme/policy").json()
    assert put.json() == got
    assert got["effective"]["egress_allow"] == ["pypi.org", "files.pythonhosted.org", "api.example.com"]
    assert got["egress_ceiling"] == ["pypi.org", "files.pythonhosted.org", "*.example.com"]
    assert "egress_allow" not in got["effective"]["limits"] and "egress_allow" not in got["ceilings"]
    assert bound_allow_list(api, keys, sandboxes, rdb, redis_prefix, "acme") == [
        "pypi.org", "files.pythonhosted.org", "api.example.com"]


def test_entries_are_stored_as_the_egress_proxy_reads_them(
        api: Api, keys: Keys, rdb: redis.Redis, redis_prefix: str, sandboxes: Sandboxes) -> None:
    publish_egress_ceiling(rdb, redis_prefix, ["*", "*:8443"])
    with api.client(keys.token("ops", admin=True)) as admin:
        put = admin.put("/v1/workspaces/acme/policy",
                        json={"egress_allow": ["Bücher.Example.", "PyPI.org:443", "pypi.org", "*.Example.com:8443"]})
    assert put.status_code == 200, put.text
    assert put.json()["policy"]["egress_allow"] == ["xn--bcher-kva.example", "pypi.org", "*.example.com:8443"]
    assert bound_allow_list(api, keys, sandboxes, rdb, redis_prefix, "acme") == [
        "xn--bcher-kva.example", "pypi.org", "*.example.com:8443"]


def test_a_workspace_without_a_list_is_bound_to_an_empty_one(api: Api, keys: Keys, rdb: redis.Redis,
                                                               redis_prefix: str, sandboxes: Sandboxes) -> None:
    """Unset never means the ceiling: no egress."""
    publish_egress_ceiling(rdb, redis_prefix, ["*"])
    assert bound_allow_list(api, keys, sandboxes, rdb, redis_prefix, "beta") == []


@pytest.mark.parametrize("entries, says", [
    (["evil.example.net"], "evil.example.net is outside the installation's egress ceiling"),
    (["*.pypi.org"], "*.pypi.org is outside"),  # a wildcard is wider than the exact name in the ceiling
    (["pypi.org:80"], "pypi.org:80 is outside"),  # another port
    (["*"], "* is outside"),
])
def test_entries_outside_the_ceiling_are_422_naming_them_and_nothing_is_stored(
        api: Api, keys: Keys, rdb: redis.Redis, redis_prefix: str, entries: list[str], says: str) -> None:
    publish_egress_ceiling(rdb, redis_prefix, ["pypi.org", "files.pythonhosted.org"])
    key = RedisKeys(redis_prefix).workspace_policy("acme")
    with api.client(keys.token("ops", admin=True)) as admin:
        refused = admin.put("/v1/workspaces/acme/policy", json={"egress_allow": ["pypi.org", *entries]})
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert says in body["detail"] and body["fields"] == ["egress_allow"] and body["reason"] == "invalid_request"
    assert rdb.get(key) is None


def test_without_an_egress_proxy_no_list_can_be_given_but_an_empty_one_can(
        api: Api, keys: Keys, rdb: redis.Redis, redis_prefix: str) -> None:
    with api.client(keys.token("ops", admin=True)) as admin:
        refused = admin.put("/v1/workspaces/acme/policy", json={"egress_allow": ["pypi.org"]})
        assert refused.status_code == 422
        assert "no egress proxy has published a ceiling" in refused.json()["detail"]
        empty = admin.put("/v1/workspaces/acme/policy", json={"egress_allow": []})
        assert empty.status_code == 200 and empty.json()["egress_ceiling"] is None


@pytest.mark.parametrize("entries", [
    ["https://pypi.org"], ["pypi.org/simple"], ["exa mple.org"], ["*.*.example.org"], ["foo*.example.org"],
    ["127.1"], [""], ["pypi.org:0"], ["pypi.org:65536"], "pypi.org", [f"h{i}.example.org" for i in range(65)],
])
def test_malformed_entries_are_422_before_the_ceiling_is_asked(
        api: Api, keys: Keys, rdb: redis.Redis, redis_prefix: str, entries: object) -> None:
    publish_egress_ceiling(rdb, redis_prefix, ["*"])
    with api.client(keys.token("ops", admin=True)) as admin:
        refused = admin.put("/v1/workspaces/acme/policy", json={"egress_allow": entries})
    assert refused.status_code == 422, refused.text
    assert rdb.get(RedisKeys(redis_prefix).workspace_policy("acme")) is None


def test_the_admin_cli_reads_egress_allow_as_a_comma_separated_list() -> None:
    assert parse_changes(["egress_allow=pypi.org, files.pythonhosted.org", "max_concurrent_sessions=3"]) == {
        "egress_allow": ["pypi.org", "files.pythonhosted.org"], "max_concurrent_sessions": 3}
    assert parse_changes(["egress_allow=null"]) == {"egress_allow": None}
    assert parse_changes(["egress_allow=*.example.com:8443"]) == {"egress_allow": ["*.example.com:8443"]}
    shown = show_policy({"workspace": "acme", "policy": {}, "ceilings": {},
                         "effective": {"limits": {}, "allowed_images": None, "egress_allow": ["pypi.org"]},
                         "egress_ceiling": ["pypi.org", "files.pythonhosted.org"]})
    assert "egress allowed to: pypi.org (installation ceiling: pypi.org, files.pythonhosted.org)" in shown
    nothing = show_policy({"workspace": "acme", "policy": {}, "ceilings": {},
                           "effective": {"limits": {}, "allowed_images": None, "egress_allow": []},
                           "egress_ceiling": None})
    assert "egress allowed to: nowhere (installation ceiling: no egress)" in nothing
