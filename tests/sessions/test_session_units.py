"""The scheduler's pure parts, without I/O: clamping, deadlines, callers, settings, labels."""

from __future__ import annotations

import argparse

import pytest
from starlette.datastructures import Headers

from sandpool.contract import limits as catalogue
from sandpool.contract import tenancy
from sandpool.contract.operations import operation_of
from sandpool.core.errors import Forbidden, Unauthorized
from sandpool.core.settings import ConfigurationError, add_settings_arguments, settings_from_args
from sandpool.controller.provider import PoolSpec
from sandpool.sessions import limits
from sandpool.sessions.caller import STANDALONE, CallerResolver
from sandpool.sessions.forward import request_headers
from sandpool.sessions.pools import PoolDirectory
from sandpool.sessions.settings import SchedulerSettings
from sandpool.state.keys import utc_day

CEILINGS = limits.Ceilings(default_idle=300, max_idle=3600, default_lifetime=3600, max_lifetime=86400,
                           default_exec=60, max_exec=300)
TOKEN = "internal-token-0123456789"


# --- clamping --------------------------------------------------------------------------------

def test_hints_absent_take_the_defaults() -> None:
    got = limits.session_limits(CEILINGS, limits.NO_POLICY, idle_hint=None, lifetime_hint=None)
    assert got == limits.SessionLimits(300, 3600, 60, 300)


def test_hints_above_the_ceiling_are_clamped_not_refused() -> None:
    got = limits.session_limits(CEILINGS, limits.NO_POLICY, idle_hint=10**9, lifetime_hint=10**9)
    assert (got.idle_timeout_seconds, got.max_lifetime_seconds) == (3600, 86400)


def test_hints_below_the_ceiling_are_kept() -> None:
    got = limits.session_limits(CEILINGS, limits.NO_POLICY, idle_hint=5, lifetime_hint=7)
    assert (got.idle_timeout_seconds, got.max_lifetime_seconds) == (5, 7)


def test_workspace_maxima_lower_the_ceilings_and_the_defaults() -> None:
    policy = limits.WorkspacePolicy(max_idle_timeout_seconds=100, max_lifetime_seconds=200,
                                    max_exec_timeout_seconds=30)
    got = limits.session_limits(CEILINGS, policy, idle_hint=1000, lifetime_hint=None)
    assert got == limits.SessionLimits(100, 200, 30, 30)


def test_workspace_maxima_never_raise_the_operator_ceiling() -> None:
    policy = limits.WorkspacePolicy(max_idle_timeout_seconds=10**6, max_lifetime_seconds=10**7,
                                    max_exec_timeout_seconds=10**5)
    got = limits.session_limits(CEILINGS, policy, idle_hint=10**9, lifetime_hint=10**9)
    assert got == limits.SessionLimits(3600, 86400, 60, 300)


@pytest.mark.parametrize(("requested", "expected"), [(None, 60), (1, 1), (120, 120), (300, 300), (301, 300),
                                                     (10**9, 300), (0, None), (-5, None), ("5", None),
                                                     (True, None), (2.5, None)])
def test_exec_timeout(requested: object, expected: int | None) -> None:
    assert limits.exec_timeout(requested, default=60, ceiling=300) == expected


def test_exec_timeout_honours_the_workspace_maximum_of_the_call() -> None:
    assert limits.exec_timeout(200, default=60, ceiling=300, workspace_max=100) == 100
    assert limits.exec_timeout(None, default=60, ceiling=300, workspace_max=10) == 10


# --- deadlines -------------------------------------------------------------------------------

def test_deadline_is_idle_after_activity_but_never_past_the_lifetime() -> None:
    assert limits.deadline(now=1000, created_at=1000, idle=10, lifetime=100) == 1010
    assert limits.deadline(now=1095, created_at=1000, idle=10, lifetime=100) == 1100


def test_deadline_covers_a_call_in_flight() -> None:
    assert limits.deadline(now=1000, created_at=1000, idle=10, lifetime=1000, busy_for=70) == 1080
    assert limits.deadline(now=1000, created_at=1000, idle=10, lifetime=50, busy_for=70) == 1050


def test_reap_reason() -> None:
    assert limits.reap_reason(now=1099, created_at=1000, lifetime=100) == "idle"
    assert limits.reap_reason(now=1100, created_at=1000, lifetime=100) == "lifetime"


def test_budget_retry_after_points_at_utc_midnight() -> None:
    midnight = 86400 * 20000
    assert limits.seconds_until_utc_midnight(midnight - 10) == 11
    assert 1 <= limits.seconds_until_utc_midnight(midnight) <= 86401
    assert utc_day(midnight - 1) != utc_day(midnight)
    assert utc_day(0) == "1970-01-01"


# --- callers ---------------------------------------------------------------------------------

def headers(**values: str) -> Headers:
    return Headers({k.replace("_", "-"): v for k, v in values.items()})


def test_standalone_has_one_workspace_and_ignores_injected_headers() -> None:
    resolve = CallerResolver(None)
    got = resolve(Headers({tenancy.WORKSPACE: "evil", "X-Sandpool-Max-Concurrent-Sessions": "1"}))
    assert got == STANDALONE
    assert got.workspace == tenancy.STANDALONE_WORKSPACE


def injected(workspace: str = "acme", **values: str) -> dict[str, str]:
    """The headers the proxy sends: the credential, the workspace, and every forwarded limit."""
    out = {"authorization": f"Bearer {TOKEN}", tenancy.WORKSPACE: workspace}
    for limit in catalogue.forwarded():
        assert limit.header is not None
        out[limit.header] = values.get(limit.name, limit.unset)
    return out


def test_multi_tenant_reads_workspace_and_policy() -> None:
    resolve = CallerResolver(TOKEN)
    got = resolve(Headers(injected(max_concurrent_sessions="3", max_exec_timeout_seconds=" 20 ")))
    assert got.workspace == "acme"
    assert got.policy == limits.WorkspacePolicy(max_concurrent_sessions=3, max_exec_timeout_seconds=20,
                                                max_idle_timeout_seconds=0, max_lifetime_seconds=0,
                                                daily_session_seconds_budget=0)


@pytest.mark.parametrize("limit", [limit.name for limit in catalogue.forwarded()])
def test_a_limit_header_the_scheduler_expects_but_does_not_get_is_refused_never_unlimited(limit: str) -> None:
    resolve = CallerResolver(TOKEN)
    raw = injected()
    del raw[catalogue.by_name()[limit].header]
    with pytest.raises(Forbidden) as refused:
        resolve(Headers(raw))
    assert refused.value.reason == "tenancy_missing" and limit.replace("_", "-") in str(refused.value).lower()


@pytest.mark.parametrize("auth", [None, "", "Bearer", f"Bearer {TOKEN}x", f"bearer {TOKEN}", TOKEN,
                                  f"Bearer {TOKEN[:-1]}", "Basic abc"])
def test_multi_tenant_refuses_a_missing_or_wrong_credential(auth: str | None) -> None:
    resolve = CallerResolver(TOKEN)
    raw = {tenancy.WORKSPACE: "acme"}
    if auth is not None:
        raw["authorization"] = auth
    with pytest.raises(Unauthorized):
        resolve(Headers(raw))


@pytest.mark.parametrize("workspace", [None, "", "-x", "a/b", "a" * 64, "ä", "a b"])
def test_multi_tenant_fails_closed_without_a_valid_workspace(workspace: str | None) -> None:
    resolve = CallerResolver(TOKEN)
    raw = {"authorization": f"Bearer {TOKEN}"}
    if workspace is not None:
        raw[tenancy.WORKSPACE] = workspace
    with pytest.raises(Forbidden):
        resolve(Headers(raw))


@pytest.mark.parametrize("value", ["-1", "x", "1.5", "1e3", "²", "9" * 13])
def test_multi_tenant_refuses_malformed_policy_values(value: str) -> None:
    resolve = CallerResolver(TOKEN)
    with pytest.raises(Forbidden):
        resolve(Headers(injected(max_concurrent_sessions=value)))


# --- forwarding headers ------------------------------------------------------------------------

def test_forwarded_headers_carry_the_agent_secret_and_nothing_of_the_caller() -> None:
    incoming = [(b"authorization", b"Bearer caller-token"), (b"x-sandpool-workspace", b"acme"),
                (b"cookie", b"a=b"), (b"content-type", b"application/json"), (b"x-request-id", b"spoof"),
                (b"content-length", b"12"), (b"x-forwarded-for", b"1.2.3.4")]
    got = request_headers(incoming, secret="agent-secret", request_id="rid-1")
    # (The body's length is framed by the hop itself, from the bytes it sends.)
    assert sorted(got) == [("accept-encoding", "identity"), ("authorization", "Bearer agent-secret"),
                           ("content-type", "application/json"), ("x-request-id", "rid-1")]


# --- routing labels and pools ------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "op"), [
    ("POST", "/sessions", "CreateSession"), ("GET", "/sessions", None),
    ("DELETE", "/sessions/abc", "DestroySession"), ("POST", "/sessions/abc/exec", "Execute"),
    ("GET", "/sessions/abc/files/list", "ListFiles"), ("GET", "/sessions/abc/files", "GetFile"),
    ("POST", "/sessions/abc/files", "PutFile"), ("GET", "/metrics", None), ("GET", "/sessions/a/b/exec", None),
])
def test_operation_labels_are_a_closed_set(method: str, path: str, op: str | None) -> None:
    assert operation_of(method, path) == op


def test_the_route_table_and_the_matcher_agree() -> None:
    from sandpool.contract.operations import OPERATIONS, ROUTES

    assert sorted(op for _, _, op in ROUTES) == sorted(OPERATIONS)
    for method, path, op in ROUTES:
        assert operation_of(method, path.format(session_id="sess-1")) == op


def test_an_unknown_image_falls_back_to_the_default_pool() -> None:
    pools = PoolDirectory([PoolSpec(name="default", image="python"), PoolSpec(name="node", image="node:20")])
    assert pools.for_image(None).name == "default"
    assert pools.for_image("node:20").name == "node"
    assert pools.for_image("cobol").name == "default"


# --- settings --------------------------------------------------------------------------------

def parse(argv: list[str]) -> SchedulerSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, SchedulerSettings)
    return settings_from_args(SchedulerSettings, parser.parse_args(argv))


def test_the_internal_token_is_never_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, SchedulerSettings)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert "--internal-token-file" in flags
    assert "--internal-token" not in flags
    assert "SANDPOOL_INTERNAL_TOKEN" in (parser.epilog or "")


def test_no_mode_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDPOOL_INTERNAL_TOKEN", raising=False)
    with pytest.raises(ConfigurationError, match="--standalone"):
        parse([]).resolve_internal_token()


def test_both_modes_refuse_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDPOOL_INTERNAL_TOKEN", TOKEN)
    with pytest.raises(ConfigurationError, match="exclude each other"):
        parse(["--standalone"]).resolve_internal_token()


def test_token_from_env_or_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("SANDPOOL_INTERNAL_TOKEN", TOKEN)
    assert parse([]).resolve_internal_token() == TOKEN
    monkeypatch.delenv("SANDPOOL_INTERNAL_TOKEN")
    path = tmp_path / "token"
    path.write_text(TOKEN + "-file\n")
    assert parse(["--internal-token-file", str(path)]).resolve_internal_token() == TOKEN + "-file"
    path.write_text("short")
    with pytest.raises(ConfigurationError, match="too short"):
        parse(["--internal-token-file", str(path)]).resolve_internal_token()


def test_a_warm_target_above_the_ceiling_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="pool_size"):
        parse(["--standalone", "--pool-size", "20", "--max-sandboxes", "4"])


def test_defaults_above_a_lowered_ceiling_are_clamped_to_it() -> None:
    s = parse(["--standalone", "--max-exec-timeout-seconds", "30", "--max-idle-timeout-seconds", "10"])
    ceilings = limits.Ceilings(s.default_idle_timeout_seconds, s.max_idle_timeout_seconds, s.default_lifetime_seconds,
                               s.max_lifetime_seconds, s.default_exec_timeout_seconds, s.max_exec_timeout_seconds)
    got = limits.session_limits(ceilings, limits.NO_POLICY, idle_hint=None, lifetime_hint=None)
    assert (got.idle_timeout_seconds, got.exec_timeout_seconds) == (10, 30)


def test_documented_defaults() -> None:
    s = parse(["--standalone"])
    assert (s.port, s.redis_url, s.redis_prefix, s.provider, s.pool_size, s.max_sandboxes, s.image) == (
        8081, "redis://127.0.0.1:6379/0", "sandpool", "local", 2, 16, "python")
    assert (s.default_idle_timeout_seconds, s.max_idle_timeout_seconds, s.default_lifetime_seconds,
            s.max_lifetime_seconds, s.default_exec_timeout_seconds, s.max_exec_timeout_seconds) == (
        300, 3600, 3600, 86400, 60, 300)
    assert s.capacity_wait_seconds == 30 and s.reap_interval_seconds == 1 and s.controller is True


# --- agent client cache ------------------------------------------------------------------------

async def test_agent_clients_are_bounded_and_never_closed_under_a_call() -> None:
    from sandpool.sessions.forward import AgentClients, BadAddress

    clients = AgentClients(max_clients=2, connect_timeout=1)
    busy = clients.take("unix:///tmp/a.sock")  # in use
    idle = clients.take("http://127.0.0.1:1")
    clients.give_back(idle)
    assert clients.take("unix:///tmp/a.sock") is busy  # cached per address
    clients.give_back(busy)
    third = clients.take("unix:///tmp/c.sock")  # evicts the least recently used: the idle one
    assert len(clients) == 2 and idle.retired and not busy.retired
    fourth = clients.take("unix:///tmp/d.sock")  # evicts `busy`, which still has one call in flight
    assert busy.retired and not busy.closed
    clients.give_back(busy)  # its last call ends: now it is closed
    await clients.aclose()
    assert busy.closed and third.closed and fourth.closed
    with pytest.raises(BadAddress):
        clients.take("ftp://x")
    with pytest.raises(BadAddress):
        clients.take("unix://relative.sock")
