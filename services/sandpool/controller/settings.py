"""Settings of `sandpool controller`: the pools it keeps warm, the provider, the session reaper.

Every field is a flag and a `SANDPOOL_*` variable; the provider's own settings
(its class in the provider registry) join them on the command line.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from sandpool.controller.pools import PoolSettings
from sandpool.core.settings import ServingSettings
from sandpool.providers import registry
from sandpool.state.settings import RedisSettings


class ControllerSettings(ServingSettings, RedisSettings, PoolSettings):
    """Its HTTP side serves only the health checks and /metrics."""

    port: int = Field(default=8081, ge=0, le=65535, description="Port to listen on")

    provider: str = Field(default="local", description=(
        "Who runs sandboxes: " + "; ".join(f"{kind.name}, {kind.summary}" for kind in registry.PROVIDERS.values())))
    data_dir: Path | None = Field(default=None, description=(
        "Directory for the local provider's sandboxes and sockets (default: a private temporary directory)"))

    reap_interval_seconds: float = Field(default=1.0, gt=0, description="How often expired sessions are reaped")
    reap_batch: int = Field(default=256, ge=1, description="Most sessions one session reaper pass releases")
    reconcile_interval_seconds: float = Field(default=30.0, gt=0, description=(
        "How often the leader reconciles Redis with what the provider runs (the safety net under the events; "
        "a pass reads every sandbox: under 1 s of the controller's CPU per 100,000, docs/capacity.md)"))

    @field_validator("provider")
    @classmethod
    def _known_provider(cls, value: str) -> str:
        if value not in registry.PROVIDERS:
            raise ValueError(f"unknown provider {value!r} (expected one of {', '.join(registry.PROVIDERS)})")
        return value
