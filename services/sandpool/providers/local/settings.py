"""Settings of the local provider: where sandboxes live and the limits each one runs under.

Every field is a flag and a `SANDPOOL_*` variable (the controller adds them to its
own command line). Limits are per sandbox; rlimits always apply, the workspace cap
needs root (a size-capped tmpfs per workspace), and per-sandbox uids need root.
"""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path

from pydantic import Field, model_validator

from sandpool.controller.provider import PoolSpec, ProviderError
from sandpool.controller.quantities import parse_quantity
from sandpool.core.settings import CommaList, ServiceSettings
from sandpool.providers.local.environments import default_cache_dir, runnable_by_others

MIB = 1024 * 1024
NOBODY = 65534


class LocalProviderSettings(ServiceSettings):
    data_dir: Path = Field(default=Path(".sandpool"), description=(
        "Directory holding each sandbox's workspace, agent socket, secret and pid file "
        "(<data-dir>/sandboxes/<id>/); every parent must be searchable by the sandbox uid"))
    sandbox_uid: int | None = Field(default=None, ge=1, description=(
        "uid sandboxed code runs as when sandpool runs as root (default 65534, nobody); "
        "ignored with --sandbox-uid-range"))
    sandbox_gid: int | None = Field(default=None, ge=1, description="gid sandboxed code runs as (default: its uid)")
    sandbox_uid_range: str = Field(default="1000000-1099999", pattern=r"^(|\d+-\d+)$", description=(
        "When root: give each sandbox its own uid (and gid) from this inclusive range, so sandboxes "
        "cannot signal each other's processes or read each other's files; empty: one shared uid"))
    memory_mb: int = Field(default=1024, ge=64, description="Address-space limit of each sandboxed process (MiB)")
    max_processes: int = Field(default=256, ge=8, description=(
        "Processes sandboxed code may run at once (its own cgroup's pids.max; RLIMIT_NPROC without cgroups)"))
    cpu_limit: float = Field(default=1.0, ge=0, description=(
        "CPU quota of each sandbox in cores (cgroup cpu.max / cpu.cfs_quota_us), for pools that set no "
        "cpu of their own; 0: no quota"))
    max_open_files: int = Field(default=1024, ge=64, description="Open files per sandboxed process")
    max_file_size_mb: int = Field(default=512, ge=1, description="Largest file sandboxed code may write (MiB)")
    workspace_size_mb: int = Field(default=512, ge=1, description=(
        "Workspace size cap (MiB): a tmpfs of this size is mounted as each workspace when root"))
    sandboxes_outlive_controller: bool = Field(default=False, description=(
        "Keep the sandboxes (and the zygote that made them) running when the controller stops or dies; "
        "the next controller on the same data dir adopts them (sandpool up sets it)"))
    sandboxes_end_with_pid: int | None = Field(default=None, ge=1, description=(
        "With --sandboxes-outlive-controller: end the sandboxes and their zygote when this process ends "
        "(sandpool up passes its own pid, so even a killed up leaves nothing running)"))
    workspace_tmpfs: bool = Field(default=True, description=(
        "Mount a size-capped tmpfs as each workspace when running as root (memory-backed)"))
    spare_interpreter: bool = Field(default=False, description=(
        "Keep a second warm interpreter in each sandbox so a restart after a timeout is instant; "
        "costs about a third more CPU per sandbox, and sandboxes are single-use"))
    agent_log_level: str = Field(default="warning", pattern=r"^(debug|info|warning|error)$", description=(
        "Log level of each sandbox's agent (JSON lines in its sandbox directory's agent.log); info adds "
        "one line per call (tool, outcome, return code, the caller's request id), ~0.1 ms of the agent's "
        "CPU a call: the api's access line already names each Execute's tool and outcome (unless it streamed)"))
    start_timeout_seconds: float = Field(default=30.0, gt=0, description=(
        "How long a new sandbox's agent may take to report that it serves (its readiness pipe)"))
    stop_grace_seconds: float = Field(default=2.0, ge=0, description=(
        "Between SIGTERM and SIGKILL when a sandbox is destroyed"))
    agent_python: str | None = Field(default=None, description=(
        "Python that runs `-m sandpool agent` (default: the one running sandpool)"))
    launcher: str = Field(default="auto", pattern=r"^(auto|zygote|subprocess)$", description=(
        "How sandboxes start: zygote (forked in milliseconds from a warm template into their own "
        "namespaces, cgroups and read-only root; see docs/isolation.md), subprocess (a plain "
        "`sandpool agent` process), auto (the zygote on Linux, subprocess if it cannot start)"))
    isolation_disable: CommaList = Field(default_factory=list, description=(
        "Isolation layers the zygote leaves off (namespaces, filesystem, network, cgroups, "
        "unprivileged_uid, seccomp), e.g. to simulate a host without them; each is named in a warning"))
    netns_spares: int = Field(default=32, ge=0, le=1024, description=(
        "Idle network namespaces the zygote keeps to hand on; one is handed on only if its last sandbox "
        "left it pristine (docs/isolation.md); 0: a new namespace for every sandbox"))
    runner_template: bool = Field(default=True, description=(
        "Fork each sandbox's Python runner from a pre-imported template the zygote keeps outside every "
        "sandbox, instead of starting a new interpreter in each (docs/agent.md); false: start them with exec"))
    isolation_required: bool = Field(default=False, description=(
        "Refuse to start unless every isolation layer not turned off with --isolation-disable is in "
        "force (by default sandboxes start with what the host offers, and a warning names the rest)"))
    sandbox_python: str | None = Field(default=None, description=(
        "Python that runs sandboxed code in pools of the `python` environment, as the sandbox uid, instead "
        "of the built environment (`sandpool up` builds it and passes it here; without either, sandpool's "
        "own Python when other users may run it, else /usr/bin/python3, with a warning)"))
    sandbox_requirements: Path | None = Field(default=None, description=(
        "Requirements lock (with hashes) of the `python` environment (default: "
        "deploy/requirements/sandbox.txt, the sandbox image's own lock; see docs/sandboxes.md)"))
    environments_dir: Path | None = Field(default=None, description=(
        "Cache of built sandbox environments, one per lock and base Python, shared read-only by every "
        "sandbox (default: /var/cache/sandpool/environments as root, else ~/.cache/sandpool/environments)"))
    egress_socket: Path | None = Field(default=None, description=(
        "Unix socket of the egress proxy (`sandpool egress --unix-socket`): each sandbox gets an egress "
        "credential and reaches the proxy through a port on its own loopback that its agent relays to this "
        "socket, bound read-only into the sandbox (unset: sandboxes have no egress; docs/egress.md)"))
    pools_file: Path | None = Field(default=None, description=(
        "YAML file of pools; its `environments:` name the environments local sandboxes may run"))

    @model_validator(mode="after")
    def _cpu_ok(self) -> LocalProviderSettings:
        if 0 < self.cpu_limit < 0.01:
            raise ValueError("cpu_limit must be 0 (no quota) or at least 0.01 cores")
        return self

    @model_validator(mode="after")
    def _range_ok(self) -> LocalProviderSettings:
        if self.sandbox_uid_range:
            low, high = self.uid_range()
            if not 1 <= low <= high:
                raise ValueError("sandbox_uid_range must be LOW-HIGH with 1 <= LOW <= HIGH")
        return self

    def uid_range(self) -> tuple[int, int]:
        low, _, high = self.sandbox_uid_range.partition("-")
        return int(low), int(high)

    def sandboxes_dir(self) -> Path:
        return Path(self.data_dir).expanduser().absolute() / "sandboxes"

    def privileged(self) -> bool:
        """Running as root: sandboxed code drops to an unprivileged uid."""
        return os.geteuid() == 0

    def environments_cache(self) -> Path:
        if self.environments_dir is not None:
            return Path(self.environments_dir).expanduser().absolute()
        return default_cache_dir(self.privileged())


def default_sandbox_python(own: str) -> str | None:
    """sandpool's own Python if a sandbox uid can run it (a venv under /root cannot be), else the system's."""
    for candidate in (own, "/usr/bin/python3", "/usr/local/bin/python3"):
        if runnable_by_others(candidate):
            return candidate
    return None


def cpu_millis(pool: PoolSpec | None, default_cores: float) -> int | None:
    """A sandbox's CPU quota in thousandths of a core: the pool's `cpu` ("500m", "2") when it
    sets one, else the provider's --cpu-limit; None for no quota."""
    if pool is not None and pool.cpu:
        try:
            cores = parse_quantity(pool.cpu)
        except ValueError:
            raise ProviderError(f"pool {pool.name}: cpu {pool.cpu!r} is not a quantity such as 500m or 2",
                                transient=False) from None
    else:
        cores = Decimal(str(default_cores))
    millis = int(cores * 1000)
    return max(millis, 10) if cores > 0 else None
