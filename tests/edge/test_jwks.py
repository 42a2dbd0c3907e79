"""Trusted keys from a JWKS document (file or URL), selected by kid, rotated without a restart."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from testkit import wait_for

from sandpool.api.app import create_app
from sandpool.api.settings import ApiSettings
from sandpool.core.settings import ConfigurationError
from sandpool.edge.keys import parse_jwks
from sandpool.edge.keys_cli import generate_keypair, load_private_key

from .conftest import Api, CaplogServer, Keys


def jwk_of(private_path: Path, kid: str) -> dict[str, Any]:
    public = load_private_key(private_path).public_key()
    return {**json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(public)), "kid": kid, "use": "sig"}


def write_jwks(path: Path, members: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"keys": members}))
    tmp.replace(path)


def status(api: Api, token: str) -> int:
    with api.client(token) as client:
        return client.get("/v1/usage").status_code


def test_jwks_file_kid_rotation(make_api: Callable[..., Api], keys: Keys, tmp_path: Path) -> None:
    old, _ = generate_keypair(tmp_path / "old.pem")
    new, _ = generate_keypair(tmp_path / "new.pem")
    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, [jwk_of(old, "2026-01")])
    api = make_api(auth_public_keys=[], auth_jwks=str(jwks), auth_jwks_refresh_seconds=0.2)

    old_token = Keys(old, old).token(kid="2026-01")
    new_token = Keys(new, new).token(kid="2026-02")
    assert status(api, old_token) == 200
    assert status(api, new_token) == 401  # not trusted yet

    write_jwks(jwks, [jwk_of(old, "2026-01"), jwk_of(new, "2026-02")])
    assert status(api, new_token) == 200  # an unknown kid triggers a re-read: no wait for the timer
    assert status(api, old_token) == 200

    write_jwks(jwks, [jwk_of(new, "2026-02")])  # retire the old key: even its cached tokens stop
    wait_for(lambda: status(api, old_token) == 401, timeout=10, what="the retired key refused")
    assert status(api, new_token) == 200
    # A token naming the new kid but signed by the old key is a forgery.
    forged = jwt.encode({"workspace": "acme", "aud": "sandpool", "exp": int(time.time()) + 60},
                        load_private_key(old), algorithm="EdDSA", headers={"kid": "2026-02"})
    assert status(api, forged) == 401

    jwks.write_text("{not json")  # a broken document keeps the last good keys
    time.sleep(0.5)
    assert status(api, new_token) == 200


def test_jwks_url_with_rsa_and_ec_keys(make_api: Callable[..., Api], keys: Keys) -> None:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    members = [
        {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key())), "kid": "r1", "alg": "RS256"},
        {**json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key.public_key())), "kid": "e1"},
        # must never be trusted:
        {"kty": "oct", "k": jwt.utils.base64url_encode(b"secret" * 8).decode(), "kid": "h1", "alg": "HS256"},
    ]
    fetched: list[int] = []

    async def document(_: Request) -> JSONResponse:
        fetched.append(1)
        return JSONResponse({"keys": members})

    server = CaplogServer(Starlette(routes=[Route("/jwks.json", document)])).start()
    try:
        api = make_api(auth_public_keys=[], auth_jwks=f"{server.url}/jwks.json",
                           auth_algorithms=["EdDSA", "RS256", "ES256"])
        base = {"workspace": "acme", "aud": "sandpool", "exp": int(time.time()) + 60}
        rs = jwt.encode(base, rsa_key, algorithm="RS256", headers={"kid": "r1"})
        es = jwt.encode(base, ec_key, algorithm="ES256", headers={"kid": "e1"})
        es_as_rsa_kid = jwt.encode(base, ec_key, algorithm="ES256", headers={"kid": "r1"})
        hs = jwt.encode(base, "secret" * 8, algorithm="HS256", headers={"kid": "h1"})
        assert status(api, rs) == 200 and status(api, es) == 200
        assert status(api, es_as_rsa_kid) == 401 and status(api, hs) == 401
        count = len(fetched)
        for _ in range(5):  # unknown kids do not hammer the JWKS endpoint
            assert status(api, jwt.encode(base, ec_key, algorithm="ES256", headers={"kid": "zz"})) == 401
        assert len(fetched) <= count + 1
    finally:
        server.stop()


def test_parse_jwks_skips_unusable_members() -> None:
    rsa_small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    members = [
        "not an object",
        {"kty": "oct", "k": "c2VjcmV0"},
        {"kty": "RSA", **{k: v for k, v in json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_small)).items()
                          if k != "kty"}},  # private key material, and too small
        {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_small.public_key())), "kid": "small"},
        {"kty": "EC", "crv": "P-384", "x": "AA", "y": "AA"},
        {"kty": "OKP", "crv": "Ed25519", "x": "not-base64!"},
    ]
    assert parse_jwks({"keys": members}) == []
    for bad in ([], {"keys": "x"}, "text"):
        try:
            parse_jwks(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_jwks_file_without_usable_key_refuses_to_start(keys: Keys, tmp_path: Path) -> None:
    jwks = tmp_path / "empty.json"
    write_jwks(jwks, [{"kty": "oct", "k": "c2VjcmV0"}])
    for location in (jwks, tmp_path / "missing.json"):
        with pytest.raises(ConfigurationError, match="--auth-jwks"):
            create_app(ApiSettings(auth_jwks=str(location)))
