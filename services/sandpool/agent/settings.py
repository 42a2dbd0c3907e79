"""Settings of `sandpool agent`: one typed object, every field a flag and a `SANDPOOL_*` variable.

The agent is the last line between hostile code and the control plane, so it
fails closed: no per-sandbox secret, no start. Every limit is a ceiling that a
request may lower but never raise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from sandpool.core.settings import CommaList, ConfigurationError, ServiceSettings, read_secret, secret_field

MIB = 1024 * 1024


class AgentSettings(ServiceSettings):
    host: str = Field(default="127.0.0.1", description="Address to listen on (ignored with --uds)")
    port: int = Field(default=8090, ge=0, le=65535, description="TCP port to listen on (ignored with --uds)")
    uds: Path | None = Field(default=None, description="Listen on this Unix socket instead of TCP")
    workspace: Path | None = Field(default=None, description="The session's workspace directory (required)")
    log_level: str = Field(default="info", description="Log level (debug, info, warning, error)")

    agent_secret: str | None = secret_field("The per-sandbox secret callers present as a bearer token")
    secret_file: Path | None = Field(default=None, description="File holding the per-sandbox secret")

    sandbox_uid: int | None = Field(default=None, ge=1, description="When run as root: uid the interpreter and "
                                                                       "shell drop to")
    sandbox_gid: int | None = Field(default=None, ge=1, description="When run as root: gid the interpreter and "
                                                                       "shell drop to (default: --sandbox-uid)")
    python_executable: str | None = Field(default=None, description="Python running sandboxed code "
                                                                    "(default: the agent's own)")
    shell: str = Field(default="/bin/bash", description="Bash running bash_code_execution commands")
    matplotlib_cache: Path | None = Field(default=None, description=(
        "Directory with a pre-built matplotlib font cache (fontlist-v*.json), copied into each "
        "sandbox's private MPLCONFIGDIR so the first import does not rebuild it"))
    preimport: CommaList = Field(default_factory=list, description=(
        "Modules the interpreter imports before the first call (an environment's `preimport`): a "
        "fast first `import numpy`, for start time and memory per sandbox"))

    exec_timeout_seconds: float = Field(default=60.0, gt=0, description="Timeout of an exec that names none")
    max_exec_timeout_seconds: float = Field(default=300.0, gt=0,
                                            description="Ceiling of a request's timeout_seconds (clamped)")
    interrupt_grace_seconds: float = Field(default=1.0, gt=0, description="After SIGINT at a timeout, how long "
                                                                          "before everything is killed")
    stream_heartbeat_seconds: float = Field(default=5.0, gt=0, description=(
        "A streamed Execute sends a heartbeat comment after this long without other events"))
    max_output_bytes: int = Field(default=MIB, ge=1024, description="Output kept per stream per call; the rest "
                                                                    "is counted and discarded")
    max_request_bytes: int = Field(default=16 * MIB, ge=1024, description="Largest exec request body (413)")
    max_upload_bytes: int = Field(default=100 * MIB, ge=1, description="Largest file PutFile accepts (413)")
    max_read_bytes: int = Field(default=100 * MIB, ge=1, description="Largest file GetFile or the editor reads")
    max_produced_files: int = Field(default=100, ge=0, description="File references listed per exec result")
    produced_scan_limit: int = Field(default=5000, ge=0, description="Workspace entries examined per exec to "
                                                                     "find produced files")
    editor_history: int = Field(default=10, ge=0, description="undo_edit steps kept per file")
    spare_interpreter: bool = Field(default=True, description="Keep a second warmed interpreter so a restart "
                                                              "after a timeout is instant")

    rlimit_nproc: int | None = Field(default=512, ge=1, description="Processes of the sandbox uid (with "
                                                                    "--sandbox-uid only)")
    rlimit_nofile: int | None = Field(default=1024, ge=16, description="Open files per sandboxed process")
    rlimit_fsize_bytes: int | None = Field(default=1024 * MIB, ge=1, description="Largest file sandboxed code "
                                                                                 "may write")
    rlimit_as_bytes: int | None = Field(default=None, ge=16 * MIB, description="Address space per sandboxed "
                                                                               "process (unset: no limit)")

    egress_socket: Path | None = Field(default=None, description=(
        "The egress proxy's Unix socket as the sandbox sees it: sandboxed code reaches it through "
        "127.0.0.1:<port>, which the agent relays (local sandboxes; see docs/egress.md). Unset, with "
        "--egress-proxy unset too: no egress"))
    egress_proxy: str | None = Field(default=None, pattern=r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$", description=(
        "The egress proxy as HOST:PORT, reached directly (Kubernetes sandboxes: its Service)"))
    egress_credential: str | None = secret_field(
        "This sandbox's egress credential, the password of the proxy URL sandboxed code gets")
    egress_credential_file: Path | None = Field(default=None, description="File holding the egress credential")

    code_cgroup_fd: int | None = Field(default=None, ge=3, description=(
        "Inherited descriptor of the cgroup directory sandboxed code runs under (the local provider's "
        "zygote passes it; see docs/agent.md, process cap)"))
    runner_template_fd: int | None = Field(default=None, ge=3, description=(
        "Inherited socket to the zygote's runner template, which forks pre-imported runners into this "
        "sandbox (the local provider's zygote passes it; see docs/agent.md)"))
    ready_fd: int | None = Field(default=None, ge=3, description=(
        "Inherited descriptor the agent writes `ok` to, then closes, once it accepts connections with "
        "its interpreter warm (the local provider's launchers pass one: nobody polls /healthz)"))
    code_cgroup_version: int = Field(default=2, ge=1, le=2, description="cgroup version of --code-cgroup-fd")
    process_cap: int | None = Field(default=None, ge=1, description=(
        "The pids.max of --code-cgroup-fd: processes sandboxed code may run at once"))

    @model_validator(mode="after")
    def _ceilings(self) -> AgentSettings:
        if self.exec_timeout_seconds > self.max_exec_timeout_seconds:
            raise ValueError("exec_timeout_seconds must not exceed max_exec_timeout_seconds")
        if self.sandbox_gid is not None and self.sandbox_uid is None:
            raise ValueError("sandbox_gid needs sandbox_uid")
        if self.egress_socket is not None and self.egress_proxy is not None:
            raise ValueError("give egress_socket (a local sandbox) or egress_proxy (a pod), not both")
        return self

    @classmethod
    def from_values(cls, **values: Any) -> AgentSettings:
        """Settings from these values alone, validated like any others but read from no
        environment or file: pydantic-settings' sources cost ~2 ms per construction, ~15 µs
        without them. For the zygote's freshly forked agent, whose environment is empty of
        SANDPOOL_* variables anyway and whose values come from the provider."""
        settings = cls.__new__(cls)
        BaseModel.__init__(settings, **values)
        return settings

    def secret(self) -> str:
        """The per-sandbox secret; refuses to go on without one."""
        value = read_secret(self.agent_secret, self.secret_file, what="agent secret")
        if not value:
            raise ConfigurationError("no agent secret: set SANDPOOL_AGENT_SECRET or --secret-file")
        return value

    def workspace_dir(self) -> Path:
        if self.workspace is None:
            raise ConfigurationError("--workspace / SANDPOOL_WORKSPACE is required")
        path = Path(self.workspace)
        if not path.is_dir():
            raise ConfigurationError(f"--workspace {path} is not a directory")
        return path.resolve()

    def sandbox_python(self) -> str:
        """The interpreter that runs sandboxed code: --python-executable, else the agent's own."""
        return self.python_executable or sys.executable

    def effective_gid(self) -> int | None:
        return self.sandbox_gid if self.sandbox_gid is not None else self.sandbox_uid
