"""The egress limits in the catalogue, as the scheduler reads them from the proxy: `egress_allow`, the one
list-valued limit, and `max_egress_connections`, a count the lease records for the egress proxy."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from sandpool.contract import limits as catalogue
from sandpool.contract import tenancy
from sandpool.core.errors import Forbidden
from sandpool.egress.settings import EgressSettings
from sandpool.scheduler.caller import STANDALONE, CallerResolver
from sandpool.scheduler.limits import Ceilings, lease_limits
from sandpool.scheduler.settings import SchedulerSettings

TOKEN = "internal-credential-for-the-catalogue-tests"


def injected(**values: str) -> dict[str, str]:
    out = {"authorization": f"Bearer {TOKEN}", tenancy.WORKSPACE: "acme"}
    for limit in catalogue.forwarded():
        assert limit.header is not None
        out[limit.header] = values.get(limit.name, limit.unset)
    return out


def test_egress_allow_is_a_list_limit_the_lease_binds() -> None:
    limit = catalogue.by_name()["egress_allow"]
    assert limit.is_list and limit.enforced_by == "lease" and limit.ceiling_owner == "egress"
    assert limit.header == "X-Sandpool-Egress-Allow" and limit.unset == ""
    assert limit in catalogue.forwarded() and limit not in catalogue.counts()
    assert "egress_allow" not in catalogue.combine_all({}, {})


def test_the_scheduler_reads_the_list_and_leaves_it_out_of_the_numeric_limits() -> None:
    caller = CallerResolver(TOKEN)(Headers(injected(egress_allow="pypi.org,files.pythonhosted.org:443",
                                                    max_concurrent_sessions="2")))
    assert caller.egress_allow == ("pypi.org", "files.pythonhosted.org:443")
    assert "egress_allow" not in caller.policy and caller.policy["max_concurrent_sessions"] == 2
    settings = type("S", (), {"default_idle_timeout_seconds": 1, "max_idle_timeout_seconds": 1,
                              "default_lifetime_seconds": 1, "max_lifetime_seconds": 1,
                              "default_exec_timeout_seconds": 1, "max_exec_timeout_seconds": 1})()
    assert "egress_allow" not in lease_limits(Ceilings.from_settings(settings), caller.policy)
    assert CallerResolver(TOKEN)(Headers(injected())).egress_allow == ()
    assert STANDALONE.egress_allow == ()


def test_a_missing_egress_header_is_refused_never_read_as_none() -> None:
    raw = injected()
    del raw["X-Sandpool-Egress-Allow"]
    with pytest.raises(Forbidden) as refused:
        CallerResolver(TOKEN)(Headers(raw))
    assert refused.value.reason == "tenancy_missing" and "Egress-Allow" in str(refused.value)


@pytest.mark.parametrize("value", [
    ",".join(f"h{i}.example.org" for i in range(catalogue.MAX_LIST_ENTRIES + 1)),
    "pypi.org, files.pythonhosted.org",  # a space: not what the proxy sends
    "x" * (catalogue.MAX_LIST_ENTRY_LENGTH + 1),
    "pypi.org,\x7f",
    "pypi.org,bücher.example",  # the proxy sends entries as stored; non-ASCII is not one the scheduler passes on
])
def test_a_malformed_egress_header_is_refused(value: str) -> None:
    with pytest.raises(Forbidden) as refused:
        CallerResolver(TOKEN)(Headers(injected(egress_allow=value)))
    assert refused.value.reason == "tenancy_invalid"


def test_encoding_round_trips() -> None:
    entries = ("pypi.org", "*.example.com:8443", "[2001:db8::1]:443")
    assert catalogue.decode_list(catalogue.encode_list(entries)) == entries
    assert catalogue.decode_list("") == ()


def test_the_workspace_egress_connection_cap_reaches_the_lease_for_the_egress_proxy() -> None:
    """`max_egress_connections` travels like `egress_allow`: in its header to the scheduler, into the lease's
    limits (recorded on the session, where the egress proxy reads it); its ceiling is the egress proxy's."""
    limit = catalogue.by_name()["max_egress_connections"]
    assert not limit.is_list and limit.enforced_by == "lease" and limit.ceiling_owner == "egress"
    assert limit.header == "X-Sandpool-Max-Egress-Connections" and limit in catalogue.forwarded()
    assert limit.ceiling in EgressSettings.model_fields
    caller = CallerResolver(TOKEN)(Headers(injected(max_egress_connections="5")))
    assert caller.policy["max_egress_connections"] == 5
    assert lease_limits(Ceilings.from_settings(SchedulerSettings()), caller.policy)["max_egress_connections"] == 5
