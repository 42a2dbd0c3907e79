"""Settings of `sandpool controller`: the pools it keeps warm, the provider, the session reaper.

Every field is a flag and a `SANDPOOL_*` variable; the provider's own settings
(its class in the provider registry) join them on the command line.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from sandpool.controller.pools import PoolSettings
from sandpool.providers import registry
from sandpool.state.settings import RedisSettings


class ControllerSettings(RedisSettings, PoolSettings):
    host: str = Field(default="127.0.0.1", description="Address of the health checks and /metrics")
    port: int = Field(default=8081, ge=0, le=65535, description="Port of the health checks and /metrics")
    unix_socket: Path | None = Field(default=None, description=(
        "Serve the health checks and /metrics on this Unix socket (mode 0600) instead of --host/--port"))
    log_level: str = Field(default="info", description="Log level (debug, info, warning, error)")
    start_failure_file: Path | None = Field(default=None, description=(
        "Where a failed start writes its one-line reason (a supervisor's termination message; "
        "sandpool up reads it)"))

    provider: str = Field(default="local", description=(
        "Who runs sandboxes: " + "; ".join(f"{kind.name}, {kind.summary}" for kind in registry.PROVIDERS.values())))
    data_dir: Path | None = Field(default=None, description=(
        "Directory for the local provider's sandboxes and sockets (default: a private temporary directory)"))

    reap_interval_seconds: float = Field(default=1.0, gt=0, description="How often expired sessions are reaped")
    reap_batch: int = Field(default=256, ge=1, description="Most sessions one session reaper pass releases")

    @field_validator("provider")
    @classmethod
    def _known_provider(cls, value: str) -> str:
        if value not in registry.PROVIDERS:
            raise ValueError(f"unknown provider {value!r} (expected one of {', '.join(registry.PROVIDERS)})")
        return value
