"""The edge's settings (part of `sandpool api`'s): trusted keys, accepted algorithms, the rate ceiling.

The edge fails closed: an HMAC or `none` algorithm stops the start with a
message naming the setting.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from sandpool.core.settings import CommaList, ServiceSettings

ASYMMETRIC_ALGORITHMS = ("EdDSA", "RS256", "ES256")
"""The only signature algorithms the edge can be configured to accept."""


class EdgeSettings(ServiceSettings):
    """Who may call, and the one workspace limit the edge enforces itself (the request rate)."""

    auth_public_keys: CommaList = Field(
        default_factory=list,
        description="Trusted public key PEM files (repeatable: --auth-public-key A --auth-public-key B); "
                    "each key's kid is its RFC 7638 thumbprint")
    auth_jwks: str | None = Field(default=None, description="Trusted keys as a JWKS document: a file path or an "
                                                            "https:// URL (cached, refreshed)")
    auth_jwks_refresh_seconds: float = Field(default=300.0, gt=0,
                                             description="How often the JWKS document is re-read")
    auth_algorithms: CommaList = Field(default_factory=lambda: ["EdDSA"],
                                       description="Accepted token algorithms: EdDSA, RS256, ES256 (never HS*/none)")
    auth_audience: str = Field(default="sandpool", description="Required `aud` claim of every token")
    auth_leeway_seconds: int = Field(default=30, ge=0, le=300,
                                     description="Clock skew allowed on exp, nbf and iat")
    auth_cache_size: int = Field(default=10_000, ge=0,
                                 description="Verified tokens remembered (LRU, each until its exp); 0 disables")

    # The operator's ceiling of the one workspace limit the edge enforces itself; the others
    # (lifetimes, timeouts, concurrency, budget) are the session layer's settings (contract/limits.py).
    ceiling_requests_per_minute: int = Field(default=0, ge=0,
                                             description="Ceiling of a workspace's requests per minute (0: none)")

    @field_validator("auth_algorithms")
    @classmethod
    def _asymmetric_only(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one algorithm is required")
        bad = [alg for alg in value if alg not in ASYMMETRIC_ALGORITHMS]
        if bad:
            raise ValueError(f"refused {', '.join(bad)}: only {', '.join(ASYMMETRIC_ALGORITHMS)} are accepted "
                             "(HS* and none never are)")
        return value

    @property
    def has_trusted_keys(self) -> bool:
        return bool(self.auth_public_keys or self.auth_jwks)
