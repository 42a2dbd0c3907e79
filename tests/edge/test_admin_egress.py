"""The workspace policy's egress allow-list: validated by the egress proxy's parser, bounded by the ceiling the
egress proxy published, forwarded to the scheduler comma-separated, and set from `sandpool admin` as a list."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import redis

from sandpool.client.admin_cli import parse_changes, show_policy
from sandpool.state.keys import Keys as RedisKeys

from .conftest import Echo, Keys, Proxy


def publish_egress_ceiling(rdb: redis.Redis, prefix: str, entries: list[str]) -> None:
    """What `sandpool egress` publishes at start."""
    rdb.set(RedisKeys(prefix).egress_ceiling, json.dumps(entries))


def test_an_allow_list_within_the_ceiling_is_stored_shown_and_forwarded(
        make_proxy: Callable[..., Proxy], keys: Keys, rdb: redis.Redis, redis_prefix: str, echo: Echo) -> None:
    proxy = make_proxy()
    publish_egress_ceiling(rdb, redis_prefix, ["pypi.org", "files.pythonhosted.org", "*.example.com"])
    with proxy.client(keys.token("ops", admin=True)) as admin:
        put = admin.put("/v1/workspaces/acme/policy",
                        json={"egress_allow": ["pypi.org", "files.pythonhosted.org", "api.example.com"]})
        assert put.status_code == 200, put.text
        got = admin.get("/v1/workspaces/acme/policy").json()
    assert put.json() == got
    assert got["effective"]["egress_allow"] == ["pypi.org", "files.pythonhosted.org", "api.example.com"]
    assert got["egress_ceiling"] == ["pypi.org", "files.pythonhosted.org", "*.example.com"]
    assert "egress_allow" not in got["effective"]["limits"] and "egress_allow" not in got["ceilings"]
    with proxy.client(keys.token("acme")) as client:
        assert client.post("/sessions", json={}).status_code == 201
    [seen] = echo.seen
    assert seen.header("x-sandpool-egress-allow") == ["pypi.org,files.pythonhosted.org,api.example.com"]


def test_entries_are_stored_as_the_egress_proxy_reads_them(
        make_proxy: Callable[..., Proxy], keys: Keys, rdb: redis.Redis, redis_prefix: str, echo: Echo) -> None:
    proxy = make_proxy()
    publish_egress_ceiling(rdb, redis_prefix, ["*", "*:8443"])
    with proxy.client(keys.token("ops", admin=True)) as admin:
        put = admin.put("/v1/workspaces/acme/policy",
                        json={"egress_allow": ["Bücher.Example.", "PyPI.org:443", "pypi.org", "*.Example.com:8443"]})
    assert put.status_code == 200, put.text
    assert put.json()["policy"]["egress_allow"] == ["xn--bcher-kva.example", "pypi.org", "*.example.com:8443"]
    with proxy.client(keys.token("acme")) as client:
        assert client.post("/sessions", json={}).status_code == 201
    [seen] = echo.seen
    assert seen.header("x-sandpool-egress-allow") == ["xn--bcher-kva.example,pypi.org,*.example.com:8443"]


def test_a_workspace_without_a_list_sends_an_empty_one(proxy: Proxy, keys: Keys, echo: Echo) -> None:
    """Unset never means the ceiling: no egress."""
    with proxy.client(keys.token("beta")) as client:
        assert client.post("/sessions", json={}).status_code == 201
    [seen] = echo.seen
    assert seen.header("x-sandpool-egress-allow") == [""]


@pytest.mark.parametrize("entries, says", [
    (["evil.example.net"], "evil.example.net is outside the installation's egress ceiling"),
    (["*.pypi.org"], "*.pypi.org is outside"),  # a wildcard is wider than the exact name in the ceiling
    (["pypi.org:80"], "pypi.org:80 is outside"),  # another port
    (["*"], "* is outside"),
])
def test_entries_outside_the_ceiling_are_422_naming_them_and_nothing_is_stored(
        make_proxy: Callable[..., Proxy], keys: Keys, rdb: redis.Redis, redis_prefix: str,
        entries: list[str], says: str) -> None:
    proxy = make_proxy()
    publish_egress_ceiling(rdb, redis_prefix, ["pypi.org", "files.pythonhosted.org"])
    key = RedisKeys(redis_prefix).workspace_policy("acme")
    with proxy.client(keys.token("ops", admin=True)) as admin:
        refused = admin.put("/v1/workspaces/acme/policy", json={"egress_allow": ["pypi.org", *entries]})
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert says in body["detail"] and body["fields"] == ["egress_allow"] and body["reason"] == "invalid_request"
    assert rdb.get(key) is None


def test_without_an_egress_proxy_no_list_can_be_given_but_an_empty_one_can(
        proxy: Proxy, keys: Keys, rdb: redis.Redis, redis_prefix: str) -> None:
    with proxy.client(keys.token("ops", admin=True)) as admin:
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
        make_proxy: Callable[..., Proxy], keys: Keys, rdb: redis.Redis, redis_prefix: str, entries: object) -> None:
    proxy = make_proxy()
    publish_egress_ceiling(rdb, redis_prefix, ["*"])
    with proxy.client(keys.token("ops", admin=True)) as admin:
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
