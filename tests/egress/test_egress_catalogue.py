"""The egress limits in the catalogue, as the edge hands them to the session layer: `egress_allow`, the one
list-valued limit, and `max_egress_connections`, a count the lease records for the egress proxy.

The edge reads a workspace's stored policy (`edge.policy.effective`) and hands the session layer a
`Caller` in process: the numeric limits in `limits`, the allow-list apart in `egress_allow`, which the
lease binds to the new session's egress credential. Nothing of it travels in a request header any more.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from testkit import ThreadServer

from sandpool.contract import limits as catalogue
from sandpool.edge.policy import CorruptPolicy, PolicyCodec, dump_policy, effective, policy_model
from sandpool.egress.settings import EgressSettings
from sandpool.sessions.caller import STANDALONE, Caller
from sandpool.sessions.limits import Ceilings, lease_limits
from sandpool.state.keys import egress_digest

from .conftest import Egress, Outside, connect_head, raw_request


def test_egress_allow_is_a_list_limit_the_lease_binds() -> None:
    limit = catalogue.by_name()["egress_allow"]
    assert limit.is_list and limit.enforced_by == "lease" and limit.ceiling_owner == "egress"
    assert limit in catalogue.lists() and limit not in catalogue.counts()
    assert "egress_allow" not in catalogue.combine_all({}, {})


def test_the_edge_hands_the_list_over_apart_from_the_numeric_limits() -> None:
    stored = policy_model()(egress_allow=["pypi.org", "files.pythonhosted.org:443", "Bücher.example"],
                            max_concurrent_sessions=2)
    handed = effective(stored, {})
    # Canonical, as the egress proxy reads it: port 443 implied, IDNA as ASCII.
    assert handed.egress_allow == ("pypi.org", "files.pythonhosted.org", "xn--bcher-kva.example")
    assert "egress_allow" not in handed.limits and handed.limits["max_concurrent_sessions"] == 2
    caller = Caller.of("acme", handed.limits, handed.egress_allow)
    assert caller.egress_allow == handed.egress_allow
    assert "egress_allow" not in caller.policy and caller.policy["max_concurrent_sessions"] == 2
    settings = type("S", (), {"default_idle_timeout_seconds": 1, "max_idle_timeout_seconds": 1,
                              "default_lifetime_seconds": 1, "max_lifetime_seconds": 1,
                              "default_exec_timeout_seconds": 1, "max_exec_timeout_seconds": 1})()
    assert "egress_allow" not in lease_limits(Ceilings.from_settings(settings), caller.policy)


def test_no_list_of_its_own_is_no_egress_never_the_ceiling() -> None:
    codec = PolicyCodec({})
    assert codec.decode(None).egress_allow == ()
    assert codec.decode(dump_policy(policy_model()(max_concurrent_sessions=3))).egress_allow == ()
    assert codec.decode(dump_policy(policy_model()(egress_allow=[]))).egress_allow == ()
    assert Caller.of("acme", {}).egress_allow == () and STANDALONE.egress_allow == ()


@pytest.mark.parametrize("entries", [
    [f"h{i}.example.org" for i in range(catalogue.MAX_LIST_ENTRIES + 1)],
    ["x" * (catalogue.MAX_LIST_ENTRY_LENGTH + 1)],
    ["pypi.org,files.pythonhosted.org"],  # one entry holding two
    ["pypi.org files.pythonhosted.org"],
    ["pypi.org", "\x7f"],
    ["http://pypi.org"],
    ["pypi.org:0"],
    [""],
])
def test_a_malformed_list_is_refused_by_the_policy_model(entries: list[str]) -> None:
    with pytest.raises(ValidationError):
        policy_model()(egress_allow=entries)


def test_a_stored_list_that_does_not_parse_refuses_the_workspace() -> None:
    """A record written around the admin API (or by an older release) fails closed, never "any host"."""
    with pytest.raises(CorruptPolicy):
        PolicyCodec({}).decode(json.dumps({"egress_allow": ["pypi.org files.pythonhosted.org"]}))


async def test_a_workspaces_list_reaches_the_lease_through_the_api(egress: Egress, outside: Outside,
                                                                   redis_url: str, redis_prefix: str,
                                                                   tmp_path: Path) -> None:
    """A multi-tenant api leases for a token's workspace: the sandbox's egress credential is bound to
    the new session with the workspace's stored allow-list (an inbound X-Sandpool-Egress-Allow header
    changes nothing), and the egress proxy lets the session reach exactly that."""
    from sandpool.api.app import create_app
    from sandpool.api.settings import ApiSettings
    from sandpool.edge.keys_cli import generate_keypair, mint_token

    private, public = generate_keypair(tmp_path / "keys" / "signing.pem")
    allowed = f"files.example.test:{outside.https_tap.port}"
    await egress.store.redis.set(egress.keys.workspace_policy("acme"),
                                 dump_policy(policy_model()(egress_allow=[allowed])))
    credential = secrets.token_urlsafe(32)
    sandbox, now = f"sb-{uuid.uuid4().hex[:10]}", time.time()
    assert await egress.sandboxes.register_starting(sandbox, pool="default", image="python", ceiling=1000, now=now,
                                                    owner="egress-tests")
    assert await egress.sandboxes.publish_ready(sandbox, pool="default", address="unix:///nowhere",
                                                secret="agent-secret", now=now, egress_digest=egress_digest(credential))
    server = ThreadServer(create_app(ApiSettings(auth_public_keys=[str(public)], redis_url=redis_url,
                                                 redis_prefix=redis_prefix, capacity_wait_seconds=0)),
                          log_level="warning", lifespan="on").start()
    try:
        headers = {"Authorization": f"Bearer {mint_token(private, 'acme')}",
                   "X-Sandpool-Egress-Allow": f"*:{outside.http_tap.port},evil.example.test"}
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            created = await client.post("/sessions", json={}, headers=headers)
    finally:
        server.stop()
    assert created.status_code == 201, created.text
    binding = await egress.store.binding(credential)
    assert binding is not None
    assert (binding.session, binding.workspace) == (created.json()["session_id"], "acme")
    assert json.loads(binding.allow) == [allowed]
    through = await raw_request(egress.port, connect_head(allowed, credential), read_body=False)
    assert through.status == 200, through
    refused = await raw_request(egress.port, connect_head(f"files.example.test:{outside.http_tap.port}", credential))
    assert refused.status == 403 and outside.http_tap.opened == 0


def test_the_workspace_egress_connection_cap_reaches_the_lease_for_the_egress_proxy() -> None:
    """`max_egress_connections` goes the way of the other counts: from the stored policy into the lease's
    limits (recorded on the session, where the egress proxy reads it); its ceiling is the egress proxy's."""
    limit = catalogue.by_name()["max_egress_connections"]
    assert not limit.is_list and limit.enforced_by == "lease" and limit.ceiling_owner == "egress"
    assert limit.ceiling in EgressSettings.model_fields
    caller = Caller.of("acme", effective(policy_model()(max_egress_connections=5), {}).limits)
    assert caller.policy["max_egress_connections"] == 5
    ceilings = Ceilings.from_settings(type("S", (), {"default_idle_timeout_seconds": 1, "max_idle_timeout_seconds": 1,
                                                     "default_lifetime_seconds": 1, "max_lifetime_seconds": 1,
                                                     "default_exec_timeout_seconds": 1,
                                                     "max_exec_timeout_seconds": 1})())
    assert lease_limits(ceilings, caller.policy)["max_egress_connections"] == 5
