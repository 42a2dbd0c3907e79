"""Every bad credential is a 401 that says why, never echoes the token, and changes nothing (no lease, no
counter, no policy, no revocation)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from typing import Any

import jwt
import redis
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from testkit import keys_under

from sandpool.edge.keys import thumbprint
from sandpool.edge.keys_cli import load_private_key

from .conftest import Api, Keys
from .stack import Sandboxes


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {"workspace": "acme", "aud": "sandpool", "sub": "t", "iat": now, "exp": now + 600, "jti": "j-1"}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def signed(keys: Keys, body: dict[str, Any], **header: Any) -> str:
    key = load_private_key(keys.private)
    headers = {"kid": thumbprint(key.public_key()), **header}
    return jwt.encode(body, key, algorithm="EdDSA", headers=headers)


def hs256_with_public_pem(keys: Keys) -> str:
    """The classic confusion attack: HMAC-sign with the verifier's public key as the secret."""
    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = b64(json.dumps(claims()).encode())
    secret = keys.public.read_bytes()
    sig = hmac.new(secret, f"{head}.{payload}".encode(), hashlib.sha256).digest()
    return f"{head}.{payload}.{b64(sig)}"


def alg_none() -> str:
    head = b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{head}.{b64(json.dumps(claims()).encode())}."


def tampered(keys: Keys) -> str:
    head, _, sig = signed(keys, claims()).split(".")
    forged = b64(json.dumps(claims(workspace="victim")).encode())
    return f"{head}.{forged}.{sig}"


def rs256(_: Keys) -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return jwt.encode(claims(), key, algorithm="RS256")


def es256(_: Keys) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    return jwt.encode(claims(), key, algorithm="ES256")


def untrusted_with_trusted_kid(keys: Keys, other: Keys) -> str:
    trusted_kid = thumbprint(load_private_key(keys.private).public_key())
    return jwt.encode(claims(), load_private_key(other.private), algorithm="EdDSA", headers={"kid": trusted_kid})


# (name, Authorization header builder, expected `cause`)
BAD: list[tuple[str, Callable[[Keys, Keys], str | None], str]] = [
    ("no header", lambda k, o: None, "missing_token"),
    ("basic scheme", lambda k, o: "Basic dXNlcjpwYXNzd29yZA==", "bad_scheme"),
    ("token without scheme", lambda k, o: k.token(), "bad_scheme"),
    ("bare scheme", lambda k, o: "Bearer", "malformed_token"),
    ("not a jwt", lambda k, o: "Bearer not-a-jwt", "malformed_token"),
    ("malformed header", lambda k, o: "Bearer !!!.e30.sig", "malformed_token"),
    ("header not json", lambda k, o: f"Bearer {b64(b'nope')}.e30.c2ln", "malformed_token"),
    ("hs256 with public pem", lambda k, o: f"Bearer {hs256_with_public_pem(k)}", "algorithm_refused"),
    ("alg none", lambda k, o: f"Bearer {alg_none()}", "algorithm_refused"),
    ("rs256 when only eddsa", lambda k, o: f"Bearer {rs256(k)}", "algorithm_refused"),
    ("es256 when only eddsa", lambda k, o: f"Bearer {es256(k)}", "algorithm_refused"),
    ("expired", lambda k, o: f"Bearer {k.token(now=time.time() - 7200, ttl_seconds=60)}", "expired"),
    ("not yet valid", lambda k, o: f"Bearer {k.token(now=time.time() + 3600)}", "not_yet_valid"),
    ("wrong audience", lambda k, o: f"Bearer {k.token(audience='someone-else')}", "bad_audience"),
    ("missing aud", lambda k, o: f"Bearer {signed(k, claims(aud=None))}", "missing_claim"),
    ("missing exp", lambda k, o: f"Bearer {signed(k, claims(exp=None))}", "missing_claim"),
    ("missing workspace", lambda k, o: f"Bearer {signed(k, claims(workspace=None))}", "missing_claim"),
    ("malformed workspace", lambda k, o: f"Bearer {signed(k, claims(workspace='../etc'))}", "bad_workspace"),
    ("workspace not a string", lambda k, o: f"Bearer {signed(k, claims(workspace=['acme']))}", "bad_workspace"),
    ("bad scope type", lambda k, o: f"Bearer {signed(k, claims(scope={'admin': True}))}", "bad_claims"),
    ("unknown kid", lambda k, o: f"Bearer {signed(k, claims(), kid='nope')}", "unknown_key"),
    ("tampered payload", lambda k, o: f"Bearer {tampered(k)}", "bad_signature"),
    ("untrusted key", lambda k, o: f"Bearer {o.token()}", "unknown_key"),
    ("untrusted key, trusted kid", lambda k, o: f"Bearer {untrusted_with_trusted_kid(k, o)}", "bad_signature"),
    ("untrusted key, no kid", lambda k, o: "Bearer " + jwt.encode(claims(), load_private_key(o.private),
                                                                   algorithm="EdDSA"), "bad_signature"),
]


def test_bad_credentials_are_401_and_change_nothing(api: Api, keys: Keys, other_keys: Keys, sandboxes: Sandboxes,
                                                    rdb: redis.Redis, redis_prefix: str) -> None:
    # One api for the whole table (starting one per case would dominate the suite's time).
    sandboxes.publish()
    before = {key: rdb.dump(key) for key in keys_under(rdb, redis_prefix)}
    requests = [("POST", "/sessions", {"json": {}}),
                ("POST", "/sessions/s1/exec", {"json": {"tool": "code_execution", "input": {"code": "print(1)"}}}),
                ("DELETE", "/sessions/s1", {}),
                ("GET", "/sessions/s1/files/list", {}),
                ("GET", "/v1/usage", {}),
                ("PUT", "/v1/workspaces/acme/policy", {"json": {"requests_per_minute": 1}}),
                ("POST", "/v1/revocations", {"json": {"jti": "x", "ttl": 5}})]
    expected_failures: dict[str, int] = {}
    with api.client() as client:
        for name, authorization, cause in BAD:
            header = authorization(keys, other_keys)
            for method, path, kwargs in requests:
                headers = {"Authorization": header} if header is not None else {}
                response = client.request(method, path, headers=headers, **kwargs)
                assert response.status_code == 401, (name, path, response.text)
                assert response.headers["www-authenticate"] == "Bearer", name
                body = response.json()
                assert body["reason"] == "unauthorized" and body["cause"] == cause and body["detail"], (name, body)
                if header:
                    for part in header.split(" ")[-1].split("."):
                        assert len(part) <= 8 or part not in response.text, name
            expected_failures[cause] = expected_failures.get(cause, 0) + len(requests)
        metrics = client.get("/metrics").text
    # Nothing leased, no rate counted, no policy written, nothing revoked: Redis is as it was.
    assert {key: rdb.dump(key) for key in keys_under(rdb, redis_prefix)} == before
    assert sandboxes.ready() == 1
    for cause, count in expected_failures.items():
        assert f'sandpool_auth_failures_total{{reason="{cause}"}} {float(count)}' in metrics, cause


def test_good_token_passes_the_edge(api: Api, keys: Keys) -> None:
    token = keys.token()
    with api.client(token) as client:
        for _ in range(3):  # past the edge, to the session layer: an unknown session, not a credential problem
            response = client.post("/sessions/s1/exec", json={"tool": "bash_code_execution",
                                                              "input": {"command": "true"}})
            assert response.status_code == 404 and response.json()["reason"] == "not_found", response.text
        metrics = client.get("/metrics").text
    assert "sandpool_auth_failures_total{" not in metrics


def test_scope_as_list_or_string_opens_admin(api: Api, keys: Keys) -> None:
    as_list = signed(keys, claims(scope=["read", "admin"]))
    as_string = signed(keys, claims(scope="read admin"))
    not_admin = signed(keys, claims(scope="read administrator"))
    for token, status in [(as_list, 200), (as_string, 200), (not_admin, 403)]:
        with api.client(token) as client:
            assert client.get("/v1/workspaces/acme/policy").status_code == status


def test_leeway_admits_small_clock_skew(make_api: Callable[..., Api], keys: Keys) -> None:
    api = make_api(auth_leeway_seconds=60)
    skewed = keys.token(now=time.time() + 30)  # iat/nbf 30 s ahead: inside the leeway
    just_expired = keys.token(now=time.time() - 100, ttl_seconds=70)  # expired 30 s ago
    with api.client() as client:
        for token in (skewed, just_expired):
            assert client.get("/v1/usage", headers={"Authorization": f"Bearer {token}"}).status_code == 200
