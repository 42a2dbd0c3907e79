"""What `sandpool up` takes: its own settings, plus the api's and the local sandboxes' that matter on one machine.

`up` is the one command a newcomer runs, so `up --help` lists every setting that
matters on one machine: the stack's own (address, pool, Redis, auth), the local
sandboxes' (limits, isolation, the Python they run), and the session ceilings
of the api. The ones given on `up`'s command line are handed on as flags (the
session settings to the api, the pools' to both, the sandboxes' to the
controller); `SANDPOOL_*` variables reach both through the environment.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from sandpool.core.settings import CommaList, ServiceSettings, add_settings_arguments, flag_name

MANAGED_FIELDS = ("egress_socket",)
"""Local sandbox settings `up` sets itself (the egress proxy's socket is the one it starts)."""

POOL_FIELDS = ("pools_file", "max_warm")
"""Pool settings `up` offers beyond its own and hands to both the api and the controller."""

SESSION_FIELDS = (
    *POOL_FIELDS, "capacity_wait_seconds",
    "default_idle_timeout_seconds", "max_idle_timeout_seconds",
    "default_lifetime_seconds", "max_lifetime_seconds",
    "default_exec_timeout_seconds", "max_exec_timeout_seconds", "max_body_bytes",
)
"""Session-layer settings `up` offers and hands to the api (the rest keep their defaults, or come by
environment)."""


class UpSettings(ServiceSettings):
    host: str = Field(default="127.0.0.1", description="Address the stack serves on")
    port: int = Field(default=8080, ge=1, le=65535, description="Port the stack serves on")
    pool_size: int = Field(default=2, ge=0, description="Sandboxes kept warm (ready to lease)")
    max_sandboxes: int = Field(default=16, ge=1, description="Most sandboxes at once, whatever their state")
    redis_url: str | None = Field(default=None, description=(
        "Use this Redis instead of starting one (its URL reaches the children by environment, never argv)"))
    redis_prefix: str = Field(default="sandpool", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                              description="Key prefix (and cluster hash tag) of every Redis key")
    redis_port: int = Field(default=0, ge=0, le=65535, description="Port of the Redis started here (0: a free one)")
    data_dir: Path = Field(default=Path(".sandpool"), description=(
        "Directory for Redis data, keys and sandboxes (any path: agent sockets live elsewhere)"))
    auth: bool = Field(default=True, description=(
        "Authenticate clients (the api verifies JWTs); --no-auth is standalone mode: the api's session "
        "layer alone, no tokens, a single trusted client"))
    auth_public_key: Path | None = Field(default=None, description=(
        "Trust this public key (PEM) instead of generating a dev key; no token is printed then"))
    token_workspace: str = Field(default="dev", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                           description="Workspace of the printed dev token")
    token_ttl_seconds: int = Field(default=86400, ge=60, description="Lifetime of the printed dev token")
    ready_timeout_seconds: float = Field(default=120.0, gt=0, description="How long to wait for a warm pool")
    stop_grace_seconds: float = Field(default=15.0, ge=0, description="Between SIGTERM and SIGKILL at shutdown")
    log_level: str = Field(default="info", description="Log level of every process started")
    egress_allow_ceiling: CommaList = Field(default_factory=list, description=(
        "Start the egress proxy: where sandboxes may ever reach (HOST[:PORT], port 443 by default; "
        "*.example.com for names below a domain). A workspace reaches only what its policy's egress_allow "
        "names within it, e.g. for pip: --egress-allow-ceiling pypi.org,files.pythonhosted.org, then "
        "`sandpool admin policy set dev egress_allow=pypi.org,files.pythonhosted.org` (docs/egress.md). "
        "Empty: no egress proxy, sandboxes have no network"))

    @field_validator("egress_allow_ceiling")
    @classmethod
    def _ceiling(cls, value: list[str]) -> list[str]:
        from sandpool.egress import allowlist

        return allowlist.checked(value)

    @model_validator(mode="after")
    def _warm_within_ceiling(self) -> UpSettings:
        if self.pool_size > self.max_sandboxes:
            raise ValueError("pool_size exceeds max_sandboxes")
        return self


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`up`'s own flags, then the api's and the local sandboxes' (each group titled)."""
    from sandpool.api.settings import ApiSettings
    from sandpool.providers.local.settings import LocalProviderSettings

    add_settings_arguments(parser, UpSettings)
    sessions = parser.add_argument_group("sessions and pools (handed to the api; pools also to the controller)")
    add_settings_arguments(sessions, ApiSettings, exclude=set(ApiSettings.model_fields) - set(SESSION_FIELDS))
    sandboxes = parser.add_argument_group("local sandboxes (handed to the controller)")
    add_settings_arguments(sandboxes, LocalProviderSettings, exclude=set(UpSettings.model_fields)
                           | set(SESSION_FIELDS) | set(MANAGED_FIELDS))


def sandbox_fields() -> list[str]:
    """The local sandboxes' settings `up` offers (handed to the controller)."""
    from sandpool.providers.local.settings import LocalProviderSettings

    return [n for n in LocalProviderSettings.model_fields
            if n not in UpSettings.model_fields and n not in SESSION_FIELDS and n not in MANAGED_FIELDS]


def api_flags(args: argparse.Namespace) -> list[str]:
    """The api's flags for what was given on `up`'s command line beyond its own settings."""
    return as_flags(args, SESSION_FIELDS)


def controller_flags(args: argparse.Namespace) -> list[str]:
    """The controller's flags for what was given on `up`'s command line beyond its own settings."""
    return as_flags(args, [*POOL_FIELDS, *sandbox_fields()])


def as_flags(args: argparse.Namespace, names: Iterable[str]) -> list[str]:
    argv: list[str] = []
    for name in names:
        value: Any = getattr(args, name, None)
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        elif isinstance(value, list):
            argv += [flag_name(name), ",".join(map(str, value))]
        else:
            argv += [flag_name(name), str(value)]
    return argv
