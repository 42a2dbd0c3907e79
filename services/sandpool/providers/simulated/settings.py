"""Settings of the simulating provider: flags of `sandpool controller --provider simulated`.

Every field is a `--simulated-*` flag and a `SANDPOOL_SIMULATED_*` variable, apart from the
controller's and the other providers' flags on the one command line.
"""

from __future__ import annotations

from pydantic import Field

from sandpool.core.settings import ServiceSettings

MIB = 1024 * 1024


class SimulatedProviderSettings(ServiceSettings):
    simulated_host: str = Field(default="127.0.0.1", description=(
        "Address the simulated agents' one server listens on (the api must reach it)"))
    simulated_port: int = Field(default=0, ge=0, le=65535, description=(
        "Port of the simulated agents' server (0: a free one)"))
    simulated_exec_delay_seconds: float = Field(default=0.0, ge=0, le=300, description=(
        "How long a simulated Execute takes before its fixed result"))
    simulated_max_request_bytes: int = Field(default=16 * MIB, ge=1024, description=(
        "Largest Execute body a simulated agent takes (413), as the real agent's cap"))
    simulated_max_upload_bytes: int = Field(default=100 * MIB, ge=1, description=(
        "Largest file a simulated agent's PutFile keeps (413), as the real agent's cap"))
    simulated_max_read_bytes: int = Field(default=100 * MIB, ge=1, description=(
        "Largest file a simulated agent's GetFile returns (413), as the real agent's cap"))
    simulated_max_workspace_bytes: int = Field(default=128 * MIB, ge=1, description=(
        "Bytes of files one simulated sandbox may hold in memory (503 over it, as a full workspace)"))
