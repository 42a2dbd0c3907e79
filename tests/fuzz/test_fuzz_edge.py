"""Property-based fuzzing of the edge of a real multi-tenant `sandpool api` (a controller keeping its pool warm).

Bodies of the admin API come from the api's own OpenAPI schemas (valid, one
step off, or any JSON); contract bodies from the hand-written strategies; tokens
are anything from noise to well-signed tokens with hostile claims; inbound
`X-Sandpool-*` headers are arbitrary. What must hold: no 500 (5xx only as a
reasoned `at_capacity`), every 4xx is `{"detail","reason"}`, a token the stack
did not sign never gets past the edge (a 401 with a cause), an injected header
never changes the tenant, and afterwards no session is left over.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import pytest
from fuzz_strategies import (
    check_answer,
    encoded,
    exec_documents,
    fuzz_settings,
    header_texts,
    near_schema,
    operations_of,
    paths,
    pct,
    query,
    session_ids,
    texts,
    uploads,
)
from hypothesis import event, example, given
from hypothesis import strategies as st
from sp_harness import Stack, build_stack
from testkit import wait_for

from sandpool.edge.keys_cli import load_private_key
from sandpool.state.keys import Keys

POOL = 2
ALLOWED_5XX = ("at_capacity",)
FUZZED = {("GET", "/v1/usage"), ("GET", "/v1/sessions"), ("GET", "/v1/workspaces/{workspace}/policy"),
          ("PUT", "/v1/workspaces/{workspace}/policy"), ("POST", "/v1/revocations"), ("POST", "/sessions"),
          ("DELETE", "/sessions/{session_id}"), ("POST", "/sessions/{session_id}/exec"),
          ("GET", "/sessions/{session_id}/files/list"), ("GET", "/sessions/{session_id}/files"),
          ("POST", "/sessions/{session_id}/files"), ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"),
          ("GET", "/sessions/{session_id}"), ("DELETE", "/v1/sessions/{session_id}"),
          ("DELETE", "/sessions/{session_id}/exec")}
TENANT = "acme"


class Edge:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.client = stack.client(TENANT)
        self.admin = stack.client("ops", admin=True)
        self.spec = self._spec()
        self.sid = ""
        self.renew()

    def _spec(self) -> dict[str, Any]:
        # The api serves its own document: fuzz what the running process says it accepts.
        response = self.client.get("/openapi.json")
        assert response.status_code == 200, response.text
        return response.json()

    def schema(self, method: str, path: str) -> dict[str, Any]:
        return self.spec["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]

    def renew(self) -> None:
        response = wait_for(lambda: (r := self.client.post("/sessions", json={})).status_code == 201 and r,
                            timeout=60, what="a session")
        self.sid = response.json()["session_id"]
        done = self.client.post(f"/sessions/{self.sid}/exec", json={
            "tool": "bash_code_execution", "input": {"command": "echo keep > marker.keep; mkdir -p dir"}})
        assert done.status_code == 200, done.text

    def ensure(self) -> str:
        if self.client.get(f"/sessions/{self.sid}/files/list").status_code == 404:
            self.renew()
        return self.sid


@pytest.fixture(scope="module")
def edge() -> Iterator[Edge]:
    stack = build_stack(auth=True, pool_size=POOL, max_sandboxes=POOL + 3,
                        api_args=["--capacity-wait-seconds", "3", "--max-exec-timeout-seconds", "3",
                                  "--default-exec-timeout-seconds", "2"])
    state = Edge(stack)
    yield state
    state.client.close()
    state.admin.close()
    stack.close()


def forbidden(edge: Edge) -> tuple[str, ...]:
    assert edge.stack.private_key is not None
    return (str(edge.stack.root), edge.stack.private_key.read_text())


def test_every_documented_operation_is_fuzzed(edge: Edge) -> None:
    class Served:
        def openapi(self) -> dict[str, Any]:
            return edge.spec

    documented = operations_of(Served())
    assert documented == FUZZED


# --- credentials ---------------------------------------------------------------------------

class Offset(int):
    """A time claim drawn relative to now (strategies must not depend on the clock)."""


def _claims_strategy() -> st.SearchStrategy[dict[str, Any]]:
    offsets = st.integers(min_value=-10**6, max_value=10**6).map(Offset)
    return st.fixed_dictionaries({}, optional={
        "workspace": st.one_of(st.sampled_from([TENANT, "../x", "", "a" * 64, "_standalone"]), texts,
                               st.integers(), st.lists(texts, max_size=2)),
        "aud": st.one_of(st.sampled_from(["sandpool", "other", ""]), st.lists(st.sampled_from(["sandpool", "x"]))),
        "exp": st.one_of(offsets, texts, st.floats(allow_nan=False)),
        "nbf": offsets,
        "iat": st.one_of(st.integers(min_value=0, max_value=2**40), texts),
        "scope": st.one_of(st.sampled_from(["admin", "", "admin admin"]), st.lists(texts, max_size=2), st.integers()),
        "jti": st.one_of(texts, st.integers())})


def _at_now(claims: dict[str, Any]) -> dict[str, Any]:
    now = int(time.time())
    return {k: (now + int(v) if isinstance(v, Offset) else v) for k, v in claims.items()}


@st.composite
def authorizations(draw: st.DrawFn, private_key: Any) -> str | None:
    kind = draw(st.sampled_from(["none", "noise", "bearer-noise", "signed", "signed-hs256", "alg-none"]))
    if kind == "none":
        return None
    if kind == "noise":
        return draw(header_texts)
    if kind == "bearer-noise":
        return "Bearer " + draw(header_texts)
    claims = _at_now(draw(_claims_strategy()))
    if kind == "signed":
        header = draw(st.fixed_dictionaries({}, optional={"kid": texts, "typ": texts, "crit": st.lists(texts)}))
        try:
            return "Bearer " + jwt.encode(claims, private_key, algorithm="EdDSA", headers=header)
        except Exception:  # noqa: BLE001 - PyJWT refuses some headers: then send noise
            return "Bearer x.y.z"
    if kind == "signed-hs256":
        return "Bearer " + jwt.encode(claims, "public-key-as-secret-" + "k" * 32, algorithm="HS256")
    return "Bearer " + jwt.encode(claims, None, algorithm="none")


def _valid_token(claims: dict[str, Any]) -> bool:
    now = time.time()
    return (claims.get("workspace") == TENANT and claims.get("aud") in ("sandpool", ["sandpool"])
            and isinstance(claims.get("exp"), int) and claims["exp"] > now + 5
            and claims.get("nbf", 0) <= now)


@given(data=st.data(), op=st.sampled_from(sorted(FUZZED - {("GET", "/healthz"), ("GET", "/readyz"),
                                                            ("GET", "/metrics")})))
@fuzz_settings(80)
def test_any_bad_credential_is_a_reasoned_401_that_reaches_nobody(edge: Edge, data: Any,
                                                                   op: tuple[str, str]) -> None:
    authorization = data.draw(authorizations(load_private_key(edge.stack.private_key)), label="authorization")
    if authorization is not None and authorization.startswith("Bearer ") and authorization.count(".") == 2:
        try:
            claims = jwt.decode(authorization[7:], options={"verify_signature": False})
        except jwt.PyJWTError:
            claims = {}
        header = jwt.get_unverified_header(authorization[7:]) if claims else {}
        if header.get("alg") == "EdDSA" and _valid_token(claims):
            return  # a genuinely valid token: not this property's business
    method, template = op
    url = template.replace("{session_id}", "nope").replace("{workspace}", TENANT)
    headers = {"Authorization": authorization} if authorization is not None else {}
    try:
        response = httpx.request(method, edge.stack.api.url + url, headers=headers, timeout=30,
                                 json={} if method in ("POST", "PUT") else None)
    except (httpx.LocalProtocolError, UnicodeEncodeError):
        return
    event(f"status {response.status_code}")
    check_answer(response, forbidden=forbidden(edge))
    assert response.status_code == 401, (authorization, response.text)
    assert response.json().get("cause"), response.text


# --- the contract through the edge -------------------------------------------------------------

@given(body=encoded(st.one_of(st.fixed_dictionaries({}, optional={
    "idle_timeout_seconds": st.integers(min_value=-2, max_value=2**63), "max_lifetime_seconds": st.integers(),
    "image": st.one_of(st.sampled_from(["python", "nope"]), texts)}), st.just({"image": "a", "image2": 1}))),
    injected=st.dictionaries(st.sampled_from(["X-Sandpool-Workspace", "X-Sandpool-Max-Concurrent-Sessions",
                                              "X-Sandpool-Max-Lifetime-Seconds", "x-sandpool-workspace",
                                              "X-Sandpool-Daily-Session-Seconds-Budget"]),
                             st.one_of(st.sampled_from(["victim", "0", "999999", "-1"]), header_texts), max_size=3))
@fuzz_settings(30)
@example(body=b'{"image": "python", "image": "other"}', injected={"X-Sandpool-Workspace": "victim"})
def test_create_through_the_edge_never_500s_and_injection_never_moves_the_tenant(
        edge: Edge, body: bytes, injected: dict[str, str]) -> None:
    try:
        response = edge.client.post("/sessions", content=body,
                                    headers={"Content-Type": "application/json", **injected})
    except (httpx.LocalProtocolError, UnicodeEncodeError):
        return
    event(f"status {response.status_code}")
    check_answer(response, forbidden=forbidden(edge), allowed_5xx=ALLOWED_5XX)
    assert response.status_code in (201, 400, 403, 413, 422, 429, 503), response.text[:300]
    if response.status_code == 201:
        sid = response.json()["session_id"]
        with edge.stack.rdb() as r:
            assert r.hget(Keys(edge.stack.prefix).session(sid), "workspace") == TENANT
        assert edge.client.delete(f"/sessions/{sid}").status_code == 204


@given(data=st.data())
@fuzz_settings(50)
def test_session_calls_through_the_edge_never_500(edge: Edge, data: Any) -> None:
    sid = edge.ensure()
    kind = data.draw(st.sampled_from(["exec", "list", "get", "put", "handle", "other-id", "cancel"]), label="kind")
    if kind == "cancel":
        response = edge.client.delete(f"/sessions/{sid}/exec")
        assert response.status_code == 409 and response.json()["reason"] == "no_running_call", response.text
    elif kind == "handle":
        response = edge.client.get(f"/sessions/{sid}")
        assert response.status_code == 200 and response.json()["session_id"] == sid, response.text
    elif kind == "exec":
        response = edge.client.post(f"/sessions/{sid}/exec", content=data.draw(encoded(exec_documents(paths()))),
                                    headers={"Content-Type": "application/json"})
    elif kind in ("list", "get"):
        params = {"path": data.draw(paths(), label="path")}
        url = f"/sessions/{sid}/files/list" if kind == "list" else f"/sessions/{sid}/files"
        response = edge.client.get(f"{url}?{query(params)}")
    elif kind == "put":
        try:
            response = edge.client.post(f"/sessions/{sid}/files", **data.draw(uploads(paths()), label="upload"))
        except UnicodeEncodeError:
            return  # httpx cannot put a lone surrogate in a multipart header: nothing was sent
    else:
        other = data.draw(session_ids, label="sid")
        if other == sid:
            return
        response = edge.client.get(f"/sessions/{other}/files/list")
        if response.status_code != 404:
            raise AssertionError(response.text)
    event(f"{kind} {response.status_code}")
    check_answer(response, forbidden=forbidden(edge), allowed_5xx=ALLOWED_5XX)
    assert response.status_code in (200, 201, 400, 403, 404, 409, 413, 422), (kind, response.text[:300])
    assert edge.client.get(f"/sessions/{sid}/files", params={"path": "marker.keep"}).content == b"keep\n"


# --- the admin API, from its schemas -------------------------------------------------------------

workspaces = st.one_of(st.sampled_from(["ops", "other-ws", "a" * 63, "a" * 64, "..", "-x", "_standalone"]),
                       texts).filter(lambda w: w != TENANT)


@given(data=st.data(), workspace=workspaces, as_admin=st.booleans())
@fuzz_settings(60)
@example(data=None, workspace="ops", as_admin=True)
def test_admin_api_never_500s(edge: Edge, data: Any, workspace: str, as_admin: bool) -> None:
    client = edge.admin if as_admin else edge.client
    components = edge.spec["components"]["schemas"]
    if data is None:
        calls = [("PUT", f"/v1/workspaces/{pct(workspace)}/policy", {"json": {"max_concurrent_sessions": 10**12}}),
                 ("GET", "/v1/usage?from=2026-13-01", {}), ("GET", "/v1/usage?from=9999-12-31&to=0001-01-01", {}),
                 ("GET", "/v1/sessions?limit=-1", {}),
                 ("POST", "/v1/revocations", {"json": {"jti": "j", "exp": 2**63}})]
    else:
        op = data.draw(st.sampled_from(["put-policy", "get-policy", "usage", "sessions", "revoke", "end-session"]),
                       label="op")
        if op == "end-session":
            other = data.draw(session_ids, label="session")
            if other == edge.sid:
                return
            calls = [("DELETE", f"/v1/sessions/{pct(other)}", {})]
        elif op == "put-policy":
            body = data.draw(near_schema(edge.schema("PUT", "/v1/workspaces/{workspace}/policy"), components))
            calls = [("PUT", f"/v1/workspaces/{pct(workspace).replace('.', '%2E')}/policy", {"json": body})]
        elif op == "get-policy":
            calls = [("GET", f"/v1/workspaces/{pct(workspace).replace('.', '%2E')}/policy", {})]
        elif op == "revoke":
            body = data.draw(near_schema(edge.schema("POST", "/v1/revocations"), components))
            calls = [("POST", "/v1/revocations", {"json": body})]
        else:
            params = data.draw(st.dictionaries(st.sampled_from(["workspace", "from", "to", "limit", "x"]),
                                               st.one_of(texts, st.sampled_from(["2026-01-01", "1", "0", "-5",
                                                                                 "99999999999999999999"])),
                                               max_size=3), label="params")
            calls = [("GET", f"/v1/{op}?{query(params)}", {})]
    for method, url, kwargs in calls:
        try:
            response = client.request(method, url, **kwargs)
        except ValueError:  # a body httpx cannot serialise (NaN): nothing was sent
            continue
        event(f"{method} {response.status_code}")
        check_answer(response, forbidden=forbidden(edge))
        assert response.status_code in (200, 201, 400, 403, 404, 405, 422), (method, url, response.text[:300])
        if not as_admin and method in ("PUT", "POST"):
            assert response.status_code in (403, 404, 422), response.text  # 404: no such route (empty name)


def test_fuzzing_left_no_session(edge: Edge) -> None:
    assert edge.client.delete(f"/sessions/{edge.sid}").status_code == 204
    keys = Keys(edge.stack.prefix)
    with edge.stack.rdb() as r:
        wait_for(lambda: not list(r.scan_iter(match=keys.session_prefix + "*", count=1000))
                 and r.zcard(keys.deadlines) == 0, timeout=30, what="no session left")
        wait_for(lambda: r.scard(keys.pool_members("default")) == POOL, timeout=60, what="only the warm pool")
    assert edge.admin.get("/v1/sessions", params={"workspace": TENANT}).json()["sessions"] == []
