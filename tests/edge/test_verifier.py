"""The verification cache: a repeated token skips the signature check, but never outlives its token or key."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sandpool.edge.auth import AuthFailure, Principal, TokenVerifier, bearer_token
from sandpool.edge.keyring import KeyRing
from sandpool.edge.keys_cli import generate_keypair, mint_token


class CountingVerifier(TokenVerifier):
    """Counts full verifications (signature + claims)."""

    checks = 0

    def verify(self, token: str) -> Principal:
        self.checks += 1
        return super().verify(token)


@pytest.fixture
def signing(tmp_path: Path) -> tuple[Path, Path]:
    return generate_keypair(tmp_path / "k.pem")


def verifier(public: Path, *, cache_size: int = 4, leeway: int = 0) -> CountingVerifier:
    return CountingVerifier(KeyRing([str(public)]), algorithms=["EdDSA"], audience="sandpool", leeway=leeway,
                            cache_size=cache_size)


def test_a_repeated_token_is_verified_once(signing: tuple[Path, Path]) -> None:
    private, public = signing
    v = verifier(public)
    token = mint_token(private, "acme", admin=True, jti="j1")
    for _ in range(5):
        principal = v.authenticate(f"Bearer {token}")
    assert v.checks == 1
    assert principal.workspace == "acme" and principal.is_admin and principal.jti == "j1"


def test_the_cache_is_bounded_lru(signing: tuple[Path, Path]) -> None:
    private, public = signing
    v = verifier(public, cache_size=2)
    a, b, c = (mint_token(private, ws) for ws in ("a", "b", "c"))
    for token in (a, b, a, c):  # c evicts b (a was used more recently)
        v.authenticate(f"Bearer {token}")
    assert v.checks == 3
    v.authenticate(f"Bearer {a}")
    assert v.checks == 3
    v.authenticate(f"Bearer {b}")
    assert v.checks == 4


def test_a_cached_token_still_expires(signing: tuple[Path, Path]) -> None:
    private, public = signing
    v = verifier(public)
    token = mint_token(private, "acme", ttl_seconds=1, now=time.time())
    v.authenticate(f"Bearer {token}")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            v.authenticate(f"Bearer {token}")
        except AuthFailure as failure:
            assert failure.reason == "expired"
            return
        time.sleep(0.05)
    raise AssertionError("an expired token was still admitted from the cache")


def test_disabled_cache_verifies_every_time(signing: tuple[Path, Path]) -> None:
    private, public = signing
    v = verifier(public, cache_size=0)
    token = mint_token(private, "acme")
    for _ in range(3):
        v.authenticate(f"Bearer {token}")
    assert v.checks == 3


def test_bearer_parsing() -> None:
    for header, reason in [(None, "missing_token"), ("", "missing_token"), ("Token abc", "bad_scheme"),
                           ("Bearer", "malformed_token"), ("Bearer a.b", "malformed_token"),
                           ("Bearer " + "a." * 5000 + "b", "malformed_token")]:
        with pytest.raises(AuthFailure) as info:
            bearer_token(header)
        assert info.value.reason == reason
    assert bearer_token("bearer a.b.c") == "a.b.c"
