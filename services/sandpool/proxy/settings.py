"""Settings of `sandpool proxy`: one typed object, every field a flag and a `SANDPOOL_*` variable.

The proxy is the public edge, so its configuration fails closed: no trusted
key, no internal credential, or an HMAC/`none` algorithm stops the start with
a message naming the setting.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from sandpool.core.settings import CommaList, ConfigurationError, ServiceSettings, read_secret, secret_field

ASYMMETRIC_ALGORITHMS = ("EdDSA", "RS256", "ES256")
"""The only signature algorithms the proxy can be configured to accept."""


class ProxySettings(ServiceSettings):
    host: str = Field(default="127.0.0.1", description="Address to listen on")
    port: int = Field(default=8080, ge=0, le=65535, description="Port to listen on")
    log_level: str = Field(default="info", description="Log level (debug, info, warning, error)")
    tracing: bool = Field(default=False, description=(
        "Export OpenTelemetry traces over OTLP/HTTP (the tracing extra; endpoint from OTEL_EXPORTER_OTLP_*)"))
    start_failure_file: Path | None = Field(default=None, description=(
        "Where a failed start writes its one-line reason (a supervisor's termination message; "
        "sandpool up reads it)"))
    tls_cert: Path | None = Field(default=None, description="PEM certificate: serve HTTPS when given (with --tls-key)")
    tls_key: Path | None = Field(default=None, description="PEM private key of --tls-cert")

    scheduler_url: str = Field(default="http://127.0.0.1:8081",
                               description="Where the scheduler listens: http://host:port or unix:///path/to.sock")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis holding policies, rates and usage")
    redis_prefix: str = Field(default="sandpool", description="Key prefix (hash tag) shared with the scheduler")
    redis_timeout_seconds: float = Field(default=2.0, gt=0, description="Timeout of every Redis call")

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

    internal_token: str | None = secret_field("Credential the proxy presents to the scheduler")
    internal_token_file: Path | None = Field(default=None,
                                             description="File holding the credential presented to the scheduler")

    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024,
                                description="Largest request body forwarded (413 above it)")
    forward_connect_timeout_seconds: float = Field(default=2.0, gt=0,
                                                   description="Timeout connecting to the scheduler")
    forward_timeout_seconds: float = Field(default=900.0, gt=0,
                                           description="Timeout of one forwarded call (covers the longest exec)")
    forward_max_connections: int = Field(default=512, ge=1, description="Pooled connections to the scheduler")

    # The operator's ceiling of the one workspace limit the proxy enforces itself; the others
    # (lifetimes, timeouts, concurrency, budget) are the scheduler's settings (contract/limits.py).
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

    @field_validator("scheduler_url")
    @classmethod
    def _scheduler_url(cls, value: str) -> str:
        # Plain HTTP on purpose: the hop stays inside the installation (loopback, a Unix socket, or
        # the cluster network behind its NetworkPolicy); a service mesh adds TLS below it if wanted.
        if not value.startswith(("http://", "unix://")):
            raise ValueError("must be http://host:port or unix:///path")
        return value.rstrip("/")

    def resolved_internal_token(self) -> str:
        """The internal credential, from its file or the environment; refuse to run without it."""
        token = read_secret(self.internal_token, self.internal_token_file, what="internal token")
        if not token:
            raise ConfigurationError("the proxy needs the scheduler's internal credential: set "
                                     "SANDPOOL_INTERNAL_TOKEN or --internal-token-file")
        return token

    def check_startable(self) -> None:
        """What `sandpool proxy` refuses to start without, named for the operator."""
        if not self.auth_public_keys and not self.auth_jwks:
            raise ConfigurationError("no trusted key: give --auth-public-key PATH (repeatable) or --auth-jwks "
                                     "(the proxy has no unauthenticated mode; use `sandpool scheduler "
                                     "--standalone` for a single trusted client)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigurationError("--tls-cert and --tls-key go together")
        self.resolved_internal_token()
