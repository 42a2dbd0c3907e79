"""The scheduler's settings: every field is a `--flag` and a `SANDPOOL_*` variable.

Operator values here are *ceilings*: a workspace policy (injected by the proxy)
or a request hint may lower them, never raise them. Provider-specific settings
live in each provider's own settings class.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from sandpool.core.settings import (
    ConfigurationError,
    ServiceSettings,
    read_secret,
    secret_field,
)
from sandpool.providers import registry


class SchedulerSettings(ServiceSettings):
    host: str = Field(default="127.0.0.1", description="Address to listen on")
    port: int = Field(default=8081, ge=0, le=65535, description="Port to listen on")
    unix_socket: Path | None = Field(default=None, description=(
        "Listen on this Unix socket (mode 0600) instead of --host/--port: a proxy on the same host "
        "reaches it for less CPU than over TCP (sandpool up does this)"))
    log_level: str = Field(default="info", description="Log level (debug, info, warning, error)")
    tracing: bool = Field(default=False, description=(
        "Export OpenTelemetry traces over OTLP/HTTP (the tracing extra; endpoint from OTEL_EXPORTER_OTLP_*)"))
    start_failure_file: Path | None = Field(default=None, description=(
        "Where a failed start writes its one-line reason (a supervisor's termination message; "
        "sandpool up reads it)"))

    # --- mode and credentials -----------------------------------------------------------
    standalone: bool = Field(default=False, description=(
        "Standalone mode: no tenancy and no credential, a single trusted client. "
        "Without it the scheduler is multi-tenant and needs the internal credential"))
    internal_token_file: Path | None = Field(default=None, description=(
        "File holding the internal credential the proxy presents (multi-tenant mode)"))
    internal_token: str | None = secret_field(
        "The internal credential the proxy presents as a bearer token (multi-tenant mode)")

    # --- redis ---------------------------------------------------------------------------
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis holding all shared state")
    redis_prefix: str = Field(default="sandpool", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                              description="Key prefix (and cluster hash tag) of every Redis key")
    redis_timeout_seconds: float = Field(default=5.0, gt=0, description="Timeout of every Redis command")
    redis_max_connections: int = Field(default=512, ge=4, description="Redis connections per replica")

    # --- pools and the controller ------------------------------------------------------------
    provider: str = Field(default="local", description=(
        "Who runs sandboxes: " + "; ".join(f"{kind.name}, {kind.summary}" for kind in registry.PROVIDERS.values())))
    controller: bool = Field(default=True, description=(
        "Run the pool controller in this process (one leader is active across replicas)"))
    pool_size: int = Field(default=2, ge=0, description=(
        "Warm floor of the default pool: sandboxes kept ready whatever the demand"))
    max_warm: int | None = Field(default=None, ge=0, description=(
        "Warm cap of the default pool: the most kept ready when demand asks for more (default: 4 x the floor, "
        "at least 4, within the ceiling)"))
    max_sandboxes: int = Field(default=16, ge=1, description="Ceiling of the default pool (sandboxes of any state)")
    image: str = Field(default="python", min_length=1, description="Image of the default pool")
    pools_file: Path | None = Field(default=None, description=(
        "YAML file of pools (replaces the default pool); the first pool is the default one"))
    data_dir: Path | None = Field(default=None, description=(
        "Directory for the local provider's sandboxes and sockets (default: a private temporary directory)"))

    # --- session ceilings and defaults -----------------------------------------------------
    default_idle_timeout_seconds: int = Field(default=300, ge=1, description="Idle timeout when none is asked")
    max_idle_timeout_seconds: int = Field(default=3600, ge=1, description="Ceiling of the idle timeout")
    default_lifetime_seconds: int = Field(default=3600, ge=1, description="Max lifetime when none is asked")
    max_lifetime_seconds: int = Field(default=86400, ge=1, description="Ceiling of the max lifetime")
    default_exec_timeout_seconds: int = Field(default=60, ge=1, description="Exec timeout when none is asked")
    max_exec_timeout_seconds: int = Field(default=300, ge=1, description="Ceiling of the exec timeout")
    workspace_max_concurrent_sessions: int = Field(default=0, ge=0, description=(
        "Most live sessions one workspace may hold; a workspace policy may lower it (0: none)"))
    workspace_daily_session_seconds_budget: int = Field(default=0, ge=0, description=(
        "Session-seconds one workspace may use per UTC day; a workspace policy may lower it (0: none)"))

    # --- capacity and forwarding -------------------------------------------------------------
    capacity_wait_seconds: float = Field(default=30.0, ge=0, le=600, description=(
        "How long CreateSession waits for a sandbox when none is ready: below the ceiling, for one started "
        "for it; at the ceiling, for a slot a release frees, when the pool's releases of the last minute say "
        "one comes within half this wait (0: fail fast with 503 at once)"))
    retry_after_seconds: int = Field(default=1, ge=1, description=(
        "Retry-After of a 503 other than a capacity refusal (whose Retry-After follows the pool's release rate)"))
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description=(
        "Largest request body (an upload, an exec call) forwarded to a sandbox; larger is 413"))
    forward_connect_timeout_seconds: float = Field(default=2.0, gt=0, description=(
        "Timeout connecting to a sandbox's agent"))
    forward_timeout_seconds: float = Field(default=60.0, gt=0, description=(
        "Timeout of a file call to a sandbox's agent"))
    exec_grace_seconds: float = Field(default=10.0, ge=0, description=(
        "Time beyond an exec's timeout the agent has to answer before the call counts as failed"))
    agent_clients_max: int = Field(default=1024, ge=1, description=(
        "Sandbox agents whose HTTP connection pools are kept open at once"))

    # --- session reaper --------------------------------------------------------------------
    reap_interval_seconds: float = Field(default=1.0, gt=0, description="How often expired sessions are reaped")
    reap_batch: int = Field(default=256, ge=1, description="Most sessions one session reaper pass releases")

    @field_validator("provider")
    @classmethod
    def _known_provider(cls, value: str) -> str:
        if value not in registry.PROVIDERS:
            raise ValueError(f"unknown provider {value!r} (expected one of {', '.join(registry.PROVIDERS)})")
        return value

    @model_validator(mode="after")
    def _warm_within_ceiling(self) -> SchedulerSettings:
        # A default above its ceiling is lowered to it where it is used (the ceiling wins),
        # so `--max-exec-timeout-seconds 30` alone is a complete setting.
        if self.pool_size > self.max_sandboxes:
            raise ValueError("pool_size (the warm floor) exceeds max_sandboxes (the ceiling)")
        if self.max_warm is not None and not self.pool_size <= self.max_warm <= self.max_sandboxes:
            raise ValueError("max_warm (the warm cap) must be between pool_size and max_sandboxes")
        return self

    def resolve_internal_token(self) -> str | None:
        """The internal credential (None in standalone mode); refuse an ambiguous or open mode.

        A multi-tenant scheduler without a credential would trust any caller's
        tenancy headers, and a standalone one with a credential is a
        misconfiguration someone believes is protecting it: both stop the start.
        """
        token = read_secret(self.internal_token, self.internal_token_file, what="internal credential")
        if self.standalone and token:
            raise ConfigurationError(
                "--standalone and an internal credential (SANDPOOL_INTERNAL_TOKEN / --internal-token-file) "
                "exclude each other: choose one mode")
        if not self.standalone and not token:
            raise ConfigurationError(
                "no mode: pass --standalone (one trusted client, no tenancy) or give the internal credential "
                "in SANDPOOL_INTERNAL_TOKEN or --internal-token-file (multi-tenant, behind the proxy)")
        if token is not None and len(token) < 16:
            raise ConfigurationError("the internal credential is too short (at least 16 characters)")
        return token
