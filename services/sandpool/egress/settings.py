"""Settings of `sandpool egress`: one typed object, every field a flag and a `SANDPOOL_*` variable.

The ceiling (`egress_allow_ceiling`) is the installation's word on where
sandboxes may go at all: a session's allow-list only ever narrows it. Empty,
the default, means no egress whatever a workspace's policy says.

One setting exists for the test suite only and is refused anywhere else:
`--unsafe-allow-loopback-for-tests` admits loopback destinations (the tests'
stand-ins for the outside world run there), and it is accepted only together
with `--unsafe-mode tests`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from sandpool.core.settings import CommaList, ServiceSettings
from sandpool.egress import addresses, allowlist, resolver


class EgressSettings(ServiceSettings):
    host: str = Field(default="127.0.0.1", description="Address the proxy listens on")
    port: int = Field(default=3128, ge=0, le=65535, description="Port the proxy listens on (sandboxes' HTTP_PROXY)")
    unix_socket: Path | None = Field(default=None, description=(
        "Also listen on this Unix socket (local sandboxes reach the proxy through a port forwarded to it)"))
    metrics_host: str = Field(default="127.0.0.1", description="Address of the metrics listener")
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description=(
        "Serve /metrics, /healthz and /readyz on this port, apart from the port sandboxes reach (none: off)"))
    log_level: str = Field(default="info", description="Log level (debug, info, warning, error)")
    start_failure_file: Path | None = Field(default=None, description=(
        "Where a failed start writes its one-line reason (a supervisor's termination message; "
        "sandpool up reads it)"))

    redis_url: str = Field(default="redis://127.0.0.1:6379/0",
                           description="Redis holding the credentials' bindings and the usage counters")
    redis_prefix: str = Field(default="sandpool", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                              description="Key prefix (hash tag) shared with the api and the controller")
    redis_timeout_seconds: float = Field(default=2.0, gt=0, description="Timeout of every Redis call")
    redis_max_connections: int = Field(default=256, ge=4, description="Redis connections of this process")

    egress_allow_ceiling: CommaList = Field(default_factory=list, description=(
        "Destinations any session may ever reach (HOST[:PORT], port 443 by default; `*.example.com` for names "
        "below a domain, `*` for any name); a workspace's egress_allow only narrows it. Empty: no egress"))
    deny_cidrs: CommaList = Field(default_factory=list, description=(
        "Address ranges refused besides the built-in ones (the cluster's service and pod CIDRs)"))
    resolve_overrides: CommaList = Field(default_factory=list, description=(
        "NAME=ADDRESS answers used before DNS (repeatable); the address policy still applies"))

    max_connections: int = Field(default=4096, ge=1, description="Connections served at once (503 above)")
    max_connections_per_credential: int = Field(default=64, ge=1, description=(
        "Connections one sandbox may hold at once (429 above)"))
    max_connections_per_workspace: int = Field(default=1024, ge=1, description=(
        "Connections the sandboxes of one workspace may hold at once (429 above): the default and the ceiling "
        "of the workspace policy's max_egress_connections, so that no tenant takes the whole proxy"))
    max_header_bytes: int = Field(default=16384, ge=1024, le=1 << 20, description=(
        "Largest request head (431 above), and largest TLS ClientHello read (a tunnel is cut above)"))
    header_timeout_seconds: float = Field(default=10.0, gt=0, description=(
        "Time a client has to send its request head, and then its ClientHello"))
    resolve_timeout_seconds: float = Field(default=5.0, gt=0, description="Timeout of one name resolution")
    connect_timeout_seconds: float = Field(default=10.0, gt=0, description="Timeout connecting to a destination")
    idle_timeout_seconds: float = Field(default=300.0, gt=0, description=(
        "A connection on which no byte moves either way for this long is closed"))
    shutdown_grace_seconds: float = Field(default=5.0, ge=0, description=(
        "On SIGTERM, time open connections get to finish before they are cut"))

    unsafe_allow_loopback_for_tests: bool = Field(default=False, description=(
        "UNSAFE, TEST SUITE ONLY: admit loopback destinations (127.0.0.0/8, ::1); refused without "
        "--unsafe-mode tests"))
    unsafe_mode: Literal["", "tests"] = Field(default="", description=(
        "Set to `tests` to accept --unsafe-allow-loopback-for-tests; never in a deployment"))

    @field_validator("egress_allow_ceiling")
    @classmethod
    def _ceiling(cls, value: list[str]) -> list[str]:
        return allowlist.checked(value)

    @field_validator("deny_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        addresses.parse_networks(value)
        return value

    @field_validator("resolve_overrides")
    @classmethod
    def _overrides(cls, value: list[str]) -> list[str]:
        resolver.parse_overrides(value)
        return value

    @model_validator(mode="after")
    def _unsafe_needs_tests(self) -> EgressSettings:
        if self.unsafe_allow_loopback_for_tests and self.unsafe_mode != "tests":
            raise ValueError("--unsafe-allow-loopback-for-tests lets sandboxes reach this host's loopback "
                             "services and exists for the test suite only; it is refused without --unsafe-mode tests")
        return self

    def ceiling(self) -> allowlist.AllowList:
        return allowlist.parse(self.egress_allow_ceiling)

    def address_policy(self) -> addresses.AddressPolicy:
        return addresses.AddressPolicy(denied=addresses.parse_networks(self.deny_cidrs),
                                       allow_loopback=self.unsafe_allow_loopback_for_tests)
