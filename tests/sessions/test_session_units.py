"""The session layer's pure parts, without I/O: clamping, deadlines, callers, settings, labels."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sandpool.api.settings import ApiSettings
from sandpool.contract import limits as catalogue
from sandpool.contract import tenancy
from sandpool.contract.operations import operation_of
from sandpool.controller.provider import PoolSpec
from sandpool.controller.settings import ControllerSettings
from sandpool.core.settings import ConfigurationError, add_settings_arguments, settings_from_args
from sandpool.edge import policy as edge_policy
from sandpool.sessions import limits
from sandpool.sessions.caller import STANDALONE, Caller
from sandpool.sessions.forward import request_headers
from sandpool.sessions.pools import PoolDirectory
from sandpool.sessions.service import new_session_id
from sandpool.state.keys import utc_day

CEILINGS = limits.Ceilings(default_idle=300, max_idle=3600, default_lifetime=3600, max_lifetime=86400,
                           default_exec=60, max_exec=300)


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
    assert limits.reap_reason(now=1099, created_at=1000, lifetime=100, idle=60) == "idle"
    assert limits.reap_reason(now=1100, created_at=1000, lifetime=100, idle=60) == "lifetime"
    assert limits.reap_reason(now=1010, created_at=1000, lifetime=100, idle=60) == "unanswered"


def test_budget_retry_after_points_at_utc_midnight() -> None:
    midnight = 86400 * 20000
    assert limits.seconds_until_utc_midnight(midnight - 10) == 11
    assert 1 <= limits.seconds_until_utc_midnight(midnight) <= 86401
    assert utc_day(midnight - 1) != utc_day(midnight)
    assert utc_day(0) == "1970-01-01"


# --- callers ---------------------------------------------------------------------------------

SESSION_LIMITS = [limit.name for limit in catalogue.counts() if limit.enforced_by != "proxy"]
"""Every numeric limit the session layer enforces (the rate is the edge's own)."""


def test_standalone_has_one_workspace_no_policy_and_no_egress() -> None:
    assert STANDALONE.workspace == tenancy.STANDALONE_WORKSPACE
    assert STANDALONE.policy == limits.NO_POLICY and STANDALONE.egress_allow == ()


def test_the_caller_the_edge_builds_carries_the_stored_policy() -> None:
    stored = edge_policy.policy_model()(max_concurrent_sessions=3, max_exec_timeout_seconds=20,
                                        requests_per_minute=100)
    effective = edge_policy.effective(stored, {"requests_per_minute": 0})
    caller = Caller.of("acme", effective.limits, effective.egress_allow)
    assert caller.workspace == "acme"
    assert caller.policy == limits.WorkspacePolicy(max_concurrent_sessions=3, max_exec_timeout_seconds=20,
                                                   max_idle_timeout_seconds=0, max_lifetime_seconds=0,
                                                   daily_session_seconds_budget=0, max_egress_connections=0)
    assert effective.requests_per_minute == 100  # the edge's own: not handed to the session layer


def test_every_limit_the_session_layer_enforces_is_handed_over_even_unset() -> None:
    """A workspace without a policy gets 0 (none of its own: the operator's ceiling applies) for every
    limit, never a missing key a later lookup could read as anything else."""
    effective = edge_policy.PolicyCodec({}).decode(None)
    assert sorted(effective.limits) == sorted(SESSION_LIMITS)
    assert set(effective.limits.values()) == {0} and effective.egress_allow == ()
    ceilings = limits.Ceilings(1, 1, 1, 1, 1, 1, workspace={name: 5 for name in SESSION_LIMITS})
    assert limits.in_force(ceilings, Caller.of("acme", effective.limits).policy) == {name: 5 for name in SESSION_LIMITS}


@pytest.mark.parametrize("raw", ["{", "[]", '{"max_concurrent_sessions": -1}', '{"max_concurrent_sessions": "x"}',
                                 '{"unknown_limit": 1}', '{"max_concurrent_sessions": 1.5}'])
def test_an_unreadable_stored_policy_refuses_the_workspace_never_unlimited(raw: str) -> None:
    with pytest.raises(edge_policy.CorruptPolicy):
        edge_policy.PolicyCodec({}).decode(raw)


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

def parse(argv: list[str], cls: type = ApiSettings):  # type: ignore[no-untyped-def]  # ApiSettings or ControllerSettings
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, cls)
    return settings_from_args(cls, parser.parse_args(argv))


def test_no_internal_credential_and_no_scheduler_url_remain() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ApiSettings)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert not {flag for flag in flags if "internal" in flag or "scheduler" in flag or "standalone" in flag}
    assert "--no-auth" in flags


def test_no_mode_refuses_to_start() -> None:
    with pytest.raises(ConfigurationError, match="--no-auth"):
        parse([]).check_startable()


def test_both_modes_refuse_to_start(tmp_path: Path) -> None:
    key = tmp_path / "key.pub"
    key.write_text("unused")
    with pytest.raises(ConfigurationError, match="exclude each other"):
        parse(["--no-auth", "--auth-public-keys", str(key)]).check_startable()


def test_a_warm_target_above_the_ceiling_is_refused() -> None:
    for cls in (ApiSettings, ControllerSettings):
        with pytest.raises(ConfigurationError, match="pool_size"):
            parse(["--pool-size", "20", "--max-sandboxes", "4"], cls)


def test_defaults_above_a_lowered_ceiling_are_clamped_to_it() -> None:
    s = parse(["--no-auth", "--max-exec-timeout-seconds", "30", "--max-idle-timeout-seconds", "10"])
    ceilings = limits.Ceilings(s.default_idle_timeout_seconds, s.max_idle_timeout_seconds, s.default_lifetime_seconds,
                               s.max_lifetime_seconds, s.default_exec_timeout_seconds, s.max_exec_timeout_seconds)
    got = limits.session_limits(ceilings, limits.NO_POLICY, idle_hint=None, lifetime_hint=None)
    assert (got.idle_timeout_seconds, got.exec_timeout_seconds) == (10, 30)


def test_documented_defaults() -> None:
    s = parse(["--no-auth"])
    assert (s.port, s.redis_url, s.redis_prefix, s.pool_size, s.max_sandboxes, s.image) == (
        8080, "redis://127.0.0.1:6379/0", "sandpool", 2, 16, "python")
    assert (s.default_idle_timeout_seconds, s.max_idle_timeout_seconds, s.default_lifetime_seconds,
            s.max_lifetime_seconds, s.default_exec_timeout_seconds, s.max_exec_timeout_seconds) == (
        300, 3600, 3600, 86400, 60, 300)
    assert s.capacity_wait_seconds == 30
    c = parse([], ControllerSettings)
    assert (c.port, c.redis_url, c.redis_prefix, c.provider, c.pool_size, c.max_sandboxes, c.image) == (
        8081, "redis://127.0.0.1:6379/0", "sandpool", "local", 2, 16, "python")
    assert (c.reap_interval_seconds, c.reap_batch) == (1, 256)


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


def test_a_session_id_never_begins_with_a_dash_so_a_command_line_takes_it_as_it_is() -> None:
    """`sandpool admin end-session <id>` read an id beginning with '-' as an option (one id in 64
    token_urlsafe draws): 5,000 draws would show one with near certainty (1 - (63/64)^5000)."""
    ids = [new_session_id() for _ in range(5000)]
    assert not [sid for sid in ids if sid.startswith("-")]
    assert len(set(ids)) == 5000 and all(len(sid) == 22 for sid in ids)
    assert sum(sid.startswith("_") for sid in ids) > 0  # still the whole alphabet but '-' first
