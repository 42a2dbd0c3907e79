"""Bearer token verification: who is calling, and for which workspace.

The algorithm list handed to PyJWT is never taken from the token: the header's
`alg` only selects among the configured asymmetric algorithms, and each trusted
key verifies exactly one algorithm. Verified tokens are remembered in a bounded
LRU keyed by the token's SHA-256, each entry until its `exp` (plus leeway), so a
repeated token costs a hash and a dict lookup instead of a signature check.
Revocation is not cached here: the edge checks it in Redis on every request.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import jwt

from sandpool.contract.tenancy import is_valid_workspace
from sandpool.edge.keyring import KeyRing

MAX_TOKEN_BYTES = 8192
MAX_JTI_CHARS = 256

# Closed set of refusal reasons: the `reason` label of sandpool_auth_failures_total.
REASONS = ("missing_token", "bad_scheme", "malformed_token", "algorithm_refused", "unknown_key", "bad_signature",
           "expired", "not_yet_valid", "bad_audience", "missing_claim", "bad_workspace", "bad_claims", "revoked")


class AuthFailure(Exception):
    """A refused credential. The detail says why and never contains the token."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Principal:
    workspace: str
    subject: str | None
    jti: str | None
    scopes: frozenset[str]
    expires_at: float

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header."""
    if not authorization:
        raise AuthFailure("missing_token", "an Authorization: Bearer <token> header is required")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        raise AuthFailure("bad_scheme", "the Authorization scheme must be Bearer")
    token = token.strip()
    if not token or len(token) > MAX_TOKEN_BYTES or token.count(".") != 2:
        raise AuthFailure("malformed_token", "the bearer token is not a JWT")
    return token


def _scopes(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset(value.split())
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return frozenset(value)
    raise AuthFailure("bad_claims", "the scope claim must be a space-separated string or a list of strings")


def principal_from_claims(claims: dict[str, Any]) -> Principal:
    workspace = claims.get("workspace")
    if workspace is None:
        raise AuthFailure("missing_claim", "the token has no workspace claim")
    if not isinstance(workspace, str) or not is_valid_workspace(workspace):
        raise AuthFailure("bad_workspace", "the token's workspace claim is not a valid workspace name")
    jti = claims.get("jti")
    if jti is not None and (not isinstance(jti, str) or not 0 < len(jti) <= MAX_JTI_CHARS):
        raise AuthFailure("bad_claims", "the jti claim must be a non-empty string")
    sub = claims.get("sub")
    exp = claims["exp"]
    if isinstance(exp, bool) or not isinstance(exp, (int, float)):
        raise AuthFailure("bad_claims", "the exp claim must be a number")
    return Principal(workspace=workspace, subject=sub if isinstance(sub, str) else None, jti=jti,
                     scopes=_scopes(claims.get("scope")), expires_at=float(exp))


class TokenVerifier:
    def __init__(self, keyring: KeyRing, *, algorithms: list[str], audience: str, leeway: int,
                 cache_size: int) -> None:
        self.keyring = keyring
        self.algorithms = frozenset(algorithms)
        self.audience = audience
        self.leeway = leeway
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, Principal] = OrderedDict()
        self._generation = keyring.generation

    def cached(self, token: str) -> Principal | None:
        """The principal of a token verified before and still unexpired, without a signature check."""
        if self._generation != self.keyring.generation:
            self._cache.clear()
            self._generation = self.keyring.generation
        digest = hashlib.sha256(token.encode()).digest()
        principal = self._cache.get(digest)
        if principal is None:
            return None
        if principal.expires_at + self.leeway <= time.time():
            del self._cache[digest]
            return None
        self._cache.move_to_end(digest)
        return principal

    def header(self, token: str) -> tuple[str, str | None]:
        """(alg, kid) of a token, refusing any algorithm not configured (HS*, none, ...)."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise AuthFailure("malformed_token", "the bearer token's header is not valid") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.algorithms:
            raise AuthFailure("algorithm_refused",
                              f"token algorithm refused; accepted: {', '.join(sorted(self.algorithms))}")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise AuthFailure("malformed_token", "the token's kid must be a string")
        return alg, kid

    def verify(self, token: str) -> Principal:
        """Verify signature and claims (no cache); raises AuthFailure."""
        alg, kid = self.header(token)
        if kid is not None:
            key = self.keyring.get(kid)
            if key is None or key.algorithm != alg:
                raise AuthFailure("unknown_key", "the token's kid names no trusted key for its algorithm")
            candidates = [key]
        else:
            candidates = self.keyring.for_algorithm(alg)
            if not candidates:
                raise AuthFailure("unknown_key", "no trusted key for the token's algorithm")
        for key in candidates:
            try:
                claims = jwt.decode(token, key.key, algorithms=[key.algorithm], audience=self.audience,
                                    leeway=self.leeway, options={"require": ["exp", "aud"]})
            except jwt.InvalidSignatureError:
                continue
            except jwt.ExpiredSignatureError:
                raise AuthFailure("expired", "the token has expired") from None
            except jwt.ImmatureSignatureError:
                raise AuthFailure("not_yet_valid", "the token is not valid yet (nbf/iat in the future)") from None
            except jwt.InvalidAudienceError:
                raise AuthFailure("bad_audience", "the token's audience is not this service") from None
            except jwt.MissingRequiredClaimError as exc:
                raise AuthFailure("missing_claim", f"the token has no {exc.claim} claim") from None
            except jwt.DecodeError:
                raise AuthFailure("malformed_token", "the bearer token is not a valid JWT") from None
            except jwt.PyJWTError:
                raise AuthFailure("bad_claims", "the token's claims are not valid") from None
            return principal_from_claims(claims)
        raise AuthFailure("bad_signature", "the token's signature does not verify with any trusted key")

    def authenticate(self, authorization: str | None) -> Principal:
        token = bearer_token(authorization)
        principal = self.cached(token)
        if principal is not None:
            return principal
        principal = self.verify(token)
        self.remember(token, principal)
        return principal

    def remember(self, token: str, principal: Principal) -> None:
        if self.cache_size <= 0:
            return
        self._cache[hashlib.sha256(token.encode()).digest()] = principal
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
