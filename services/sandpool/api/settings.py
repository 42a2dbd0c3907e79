"""Settings of `sandpool api`: one typed object, every field a flag and a `SANDPOOL_*` variable.

The api's mode is explicit: `--no-auth` (standalone: the session layer alone,
one trusted client, no tenancy) or multi-tenant (trusted keys given). With
neither, or both, it refuses to start, naming the settings.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from sandpool.core.settings import ConfigurationError, ServingSettings
from sandpool.edge.settings import EdgeSettings
from sandpool.sessions.settings import SessionSettings


class ApiSettings(ServingSettings, EdgeSettings, SessionSettings):
    tracing: bool = Field(default=False, description=(
        "Export OpenTelemetry traces over OTLP/HTTP (the tracing extra; endpoint from OTEL_EXPORTER_OTLP_*)"))
    tls_cert: Path | None = Field(default=None, description="PEM certificate: serve HTTPS when given (with --tls-key)")
    tls_key: Path | None = Field(default=None, description="PEM private key of --tls-cert")

    auth: bool = Field(default=True, description=(
        "Authenticate clients against the trusted keys (--auth-public-key or --auth-jwks): multi-tenant. "
        "--no-auth is standalone mode: no authentication and no tenancy, for one trusted client"))

    def check_startable(self) -> None:
        """What `sandpool api` refuses to start without, named for the operator."""
        if not self.auth and self.has_trusted_keys:
            raise ConfigurationError("--no-auth and trusted keys (--auth-public-key / --auth-jwks) exclude each "
                                     "other: choose one mode")
        if self.auth and not self.has_trusted_keys:
            raise ConfigurationError("no mode: give --auth-public-key PATH (repeatable) or --auth-jwks "
                                     "(multi-tenant), or --no-auth (standalone: one trusted client, no tenancy)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigurationError("--tls-cert and --tls-key go together")
