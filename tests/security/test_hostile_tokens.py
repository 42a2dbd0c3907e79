"""Hostile credentials against the real multi-tenant `sandpool api` process of a deployed stack.

The edge suite's own table (tests/edge/test_auth.py `BAD`: alg confusion, alg
none, foreign keys, tampered payloads, bad claims...) runs here against the
deployed process on every contract and admin operation, then the table is
extended with what only a whole stack can show: a revoked token, a token that
is too large, duplicated or mixed credentials, an opaque service credential,
and the ways around the edge that are left (tenancy headers, the controller's
port). Each is a 401 (or the stated refusal) with a `cause`, gets past the edge
with nothing, reaches no sandbox, leases nothing, meters nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from edge.conftest import Keys as EdgeKeys  # the edge suite's key holder (token(), private, public)
from edge.test_auth import BAD
from sp_harness import Stack
from testkit import keys_under, wait_for

from sandpool.edge.keys_cli import generate_keypair
from sandpool.state.keys import Keys

OPERATIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/sessions", {"json": {}}),
    ("POST", "/sessions/{sid}/exec", {"json": {"tool": "code_execution", "input": {"code": "print(1)"}}}),
    ("GET", "/sessions/{sid}/files/list", {}),
    ("GET", "/sessions/{sid}/files", {"params": {"path": "marker.txt"}}),
    ("POST", "/sessions/{sid}/files", {"files": {"file": ("x.txt", b"pwned")}}),
    ("DELETE", "/sessions/{sid}", {}),
    ("GET", "/v1/usage", {}),
    ("GET", "/v1/sessions", {}),
    ("PUT", "/v1/workspaces/acme/policy", {"json": {"max_concurrent_sessions": 1}}),
    ("POST", "/v1/revocations", {"json": {"jti": "x", "ttl": 60}}),
]


@pytest.fixture(scope="module")
def keys(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> tuple[EdgeKeys, EdgeKeys]:
    trusted = EdgeKeys(stack.private_key, stack.public_key)  # type: ignore[arg-type]  # the stack made its key pair when it started
    other = EdgeKeys(*generate_keypair(tmp_path_factory.mktemp("other") / "untrusted.pem"))
    return trusted, other


@pytest.fixture(scope="module")
def victim(stack: Stack) -> Any:
    client = stack.client("acme")
    sid = client.post("/sessions", json={}).json()["session_id"]
    assert client.post(f"/sessions/{sid}/files", files={"file": ("marker.txt", b"intact")}).status_code == 201
    yield sid
    client.delete(f"/sessions/{sid}")
    client.close()


def past_the_edge(stack: Stack) -> float:
    """Requests the api answered otherwise than 401 (health, readiness and metrics aside): any that a refused
    credential got past the edge would add to it."""
    text = httpx.get(stack.api.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sandpool_requests_total{") and 'operation="' in line
               and 'status="401"' not in line
               and "healthz" not in line and "readyz" not in line and "metrics" not in line)


def tenant_state(stack: Stack) -> list[str]:
    """Every key a request could create or change: sessions, usage, rate, policy, revocations; read once no
    call is left recorded. A call's `done` (its metering, its session marked active, its record removed)
    runs just after its answer, so the owner's last upload or download may still be finishing."""
    with stack.rdb() as r:
        call_deadlines = Keys(stack.prefix).call_deadlines
        wait_for(lambda: r.zcard(call_deadlines) == 0, timeout=10, what="every answered call finished",
                 state=lambda: r.zrange(call_deadlines, 0, -1, withscores=True))
        names = keys_under(r, stack.prefix)
        return [f"{n}={r.hgetall(n) if r.type(n) == 'hash' else r.type(n)}" for n in names
                if not any(part in n for part in (":sandbox:", ":pool:", ":controller", ":doomed"))]


def refuse_everywhere(stack: Stack, sid: str, authorization: list[tuple[str, str]] | str | None,
                      cause: str | None, name: str) -> None:
    with httpx.Client(base_url=stack.api.url, timeout=30) as client:
        for method, template, kwargs in OPERATIONS:
            headers: Any = [("Authorization", authorization)] if isinstance(authorization, str) \
                else (authorization or [])
            response = client.request(method, template.format(sid=sid), headers=headers, **kwargs)
            check_refusal(response, authorization, cause, name, template)


def check_refusal(response: httpx.Response, authorization: Any, cause: str | None, name: str,
                  template: str) -> None:
    assert response.status_code == 401, (name, template, response.text)
    assert response.headers.get("www-authenticate") == "Bearer", name
    body = response.json()
    assert body["reason"] == "unauthorized" and body["detail"], (name, body)
    if cause is not None:
        assert body["cause"] == cause, (name, body)
    token = authorization if isinstance(authorization, str) else ""
    for part in token.split(" ")[-1].split("."):
        assert len(part) <= 8 or part not in response.text, name  # the token is never echoed


def test_the_edge_suites_bad_credentials_through_the_deployed_stack(
        stack: Stack, keys: tuple[EdgeKeys, EdgeKeys], victim: str) -> None:
    trusted, other = keys
    before_requests, before_state = past_the_edge(stack), tenant_state(stack)
    for name, build, cause in BAD:
        refuse_everywhere(stack, victim, build(trusted, other), cause, name)
    assert past_the_edge(stack) == before_requests  # nothing got past the edge
    assert tenant_state(stack) == before_state
    with stack.client("acme") as owner:
        assert owner.get(f"/sessions/{victim}/files", params={"path": "marker.txt"}).content == b"intact"


EXTRA: list[tuple[str, Callable[[Stack, EdgeKeys], list[tuple[str, str]] | str], str | None]] = [
    ("an opaque service credential", lambda s, k: "Bearer resilience-internal-credential-0123456789",
     "malformed_token"),
    ("token twice in one header", lambda s, k: f"Bearer {k.token('acme')} {k.token('acme')}", None),
    ("bearer with a fourth segment", lambda s, k: f"Bearer {k.token('acme')}.AAAA", "malformed_token"),
    ("a 12 KiB token", lambda s, k: "Bearer " + "e30." * 3000 + "x", None),
    ("truncated signature", lambda s, k: f"Bearer {k.token('acme')[:-2]}", "bad_signature"),
    ("two Authorization headers, a good one second",
     lambda s, k: [("Authorization", "Bearer nope"), ("Authorization", f"Bearer {k.token('acme')}")], None),
]


@pytest.mark.parametrize(("name", "build", "cause"), EXTRA, ids=[e[0] for e in EXTRA])
def test_more_hostile_credentials(stack: Stack, keys: tuple[EdgeKeys, EdgeKeys], victim: str, name: str,
                                  build: Callable[..., Any], cause: str | None) -> None:
    before_requests, before_state = past_the_edge(stack), tenant_state(stack)
    authorization = build(stack, keys[0])
    if name == "a 12 KiB token":
        # Either the edge's 401 or the HTTP server's own refusal of an oversized header: never a pass.
        response = httpx.get(f"{stack.api.url}/sessions/{victim}/files/list",
                             headers={"Authorization": authorization}, timeout=30)
        assert response.status_code in (400, 401, 431), response.text
    else:
        refuse_everywhere(stack, victim, authorization, cause, name)
    assert past_the_edge(stack) == before_requests
    assert tenant_state(stack) == before_state


def test_a_revoked_token_is_refused_at_once_everywhere(stack: Stack, victim: str) -> None:
    jti = "revoke-" + uuid.uuid4().hex
    token = stack.token("acme", jti=jti)
    with httpx.Client(base_url=stack.api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        assert c.get(f"/sessions/{victim}/files/list").status_code == 200  # verified and cached
    with stack.client("ops", admin=True) as admin:
        assert admin.post("/v1/revocations", json={"jti": jti, "ttl": 600}).status_code == 201
    before_requests = past_the_edge(stack)
    refuse_everywhere(stack, victim, f"Bearer {token}", "revoked", "revoked")
    assert past_the_edge(stack) == before_requests


def test_no_way_around_the_edge(stack: Stack, victim: str) -> None:
    """What was the proxy-to-scheduler hop is in process now: tenancy headers are nobody's input, and the
    controller's port serves no contract operation."""
    def others_state() -> list[str]:  # globex's own rate window may move: its token is valid
        return [entry for entry in tenant_state(stack) if "globex" not in entry]

    before_state = others_state()
    files = f"/sessions/{victim}/files"
    tenancy = {"X-Sandpool-Workspace": "acme", "X-Sandpool-Max-Concurrent-Sessions": "-1"}
    with httpx.Client(base_url=stack.api.url, timeout=30) as client:
        bare = client.get(files, params={"path": "marker.txt"}, headers=tenancy)
        foreign = client.get(files, params={"path": "marker.txt"},
                             headers={**tenancy, "Authorization": f"Bearer {stack.token('globex')}"})
    assert bare.status_code == 401 and bare.json()["cause"] == "missing_token", bare.text
    assert foreign.status_code == 404 and foreign.json()["reason"] == "not_found", foreign.text
    controller = stack.controllers[0].url
    for headers in ({}, {"Authorization": f"Bearer {stack.token('acme')}"}, tenancy):
        for method, path in (("GET", files), ("GET", f"/sessions/{victim}/files/list"), ("POST", "/sessions"),
                             ("GET", "/v1/usage")):
            response = httpx.request(method, controller + path, params={"path": "marker.txt"}, headers=headers,
                                     timeout=30)
            assert response.status_code in (404, 405), (method, path, response.text)
            assert b"intact" not in response.content
    assert others_state() == before_state
    # The owner's own token does read it: the probes above could have failed.
    with stack.client("acme") as owner:
        assert owner.get(files, params={"path": "marker.txt"}).content == b"intact"
