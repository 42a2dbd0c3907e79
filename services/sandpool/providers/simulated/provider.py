"""`--provider simulated`: sandboxes that are records only, served by one in-process agent server.

A benchmark and test tool (docs/capacity.md): it runs no code. It lets the real api,
controller, Redis scripts, session reaper and reconciliation carry 100,000 live sessions
on one machine, so what they cost at scale can be measured apart from what sandboxes cost.

The agent server runs in the controller's process, on its event loop, because that is
where the provider lives: a sandbox exists from `create` to `destroy`, `list` is the
provider's own table, and nothing has to be kept in step across a process boundary. The
price is that its CPU is counted in the controller's (at 0 s per Execute, the cost of an
HTTP answer), and that a controller's restart ends every simulated sandbox; the next
leader's reconciliation then releases their sessions as dead, as after a crash of the
local provider's zygote.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket

from sandpool.controller.provider import LostListener, PoolSpec, ProviderError, SandboxInfo
from sandpool.providers.simulated.files import MemoryWorkspace
from sandpool.providers.simulated.server import EmbeddedServer, SimulatedAgents, SimulatedSandbox
from sandpool.providers.simulated.settings import SimulatedProviderSettings

log = logging.getLogger(__name__)

WARNING = ("SIMULATED PROVIDER: no sandbox runs and no code is executed; every Execute answers a fixed "
           "result. For benchmarks and tests of the control plane only (docs/capacity.md)")


KEEP_ALIVE_SECONDS = 30
"""How long the server keeps an idle connection: well past the api's own idle retirement (4 s,
`core.hop`), so on a starved machine the api never sends a call on a connection the server is closing
(every simulated sandbox shares the server's connections: one such race would fail whichever
session's call it carried)."""


class SimulatedProvider:
    name = "simulated"

    def __init__(self, settings: SimulatedProviderSettings) -> None:
        self.settings = settings
        self.agents = SimulatedAgents(settings)
        self.sandboxes: dict[str, SimulatedSandbox] = {}
        self.address = ""
        self._server: EmbeddedServer | None = None
        self._serving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        log.warning(WARNING)
        import uvicorn

        s = self.settings
        sock = socket.socket(socket.AF_INET6 if ":" in s.simulated_host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((s.simulated_host, s.simulated_port))
        except OSError as exc:
            sock.close()
            raise ProviderError(f"the simulated agents cannot listen on {s.simulated_host}:{s.simulated_port}: "
                                f"{exc.strerror}", transient=False) from None
        port = sock.getsockname()[1]
        host = f"[{s.simulated_host}]" if ":" in s.simulated_host else s.simulated_host
        self.address = f"http://{host}:{port}"
        self._server = EmbeddedServer(uvicorn.Config(self.agents, lifespan="off", http="httptools",
                                                     access_log=False, log_level="warning", backlog=2048,
                                                     timeout_keep_alive=KEEP_ALIVE_SECONDS))
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]), name="simulated-agents")
        while not self._server.started:
            if self._serving.done():
                raise ProviderError("the simulated agents' server did not start", transient=False)
            await asyncio.sleep(0.01)
        log.warning("simulated agents serving", extra={"address": self.address})

    async def close(self) -> None:
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await asyncio.wait({self._serving}, timeout=5)
        self._server = self._serving = None

    async def create(self, pool: PoolSpec, sandbox_id: str) -> SandboxInfo:
        if not self.address:
            raise ProviderError("the simulated provider is not started")
        sandbox = SimulatedSandbox(sandbox_id, pool.name, secrets.token_urlsafe(24),
                                   MemoryWorkspace(max_bytes=self.settings.simulated_max_workspace_bytes))
        self.sandboxes[sandbox_id] = sandbox
        self.agents.add(sandbox)
        return self._info(sandbox)

    async def destroy(self, sandbox_id: str) -> None:
        sandbox = self.sandboxes.pop(sandbox_id, None)
        if sandbox is not None:
            self.agents.remove(sandbox)

    async def list(self) -> list[SandboxInfo]:
        return [self._info(sandbox) for sandbox in self.sandboxes.values()]

    def describe(self) -> dict[str, object]:
        return {"provider": self.name, "simulated": True, "runs_code": False, "address": self.address,
                "sandboxes": len(self.sandboxes),
                "exec_delay_seconds": self.settings.simulated_exec_delay_seconds}

    def on_lost(self, listener: LostListener) -> None:
        """A simulated sandbox never dies on its own: the listener is never called."""

    def _info(self, sandbox: SimulatedSandbox) -> SandboxInfo:
        return SandboxInfo(sandbox_id=sandbox.sandbox_id, pool=sandbox.pool, address=self.address,
                           secret=sandbox.secret, ready=True)
