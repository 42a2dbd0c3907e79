"""`--provider simulated`: sandboxes that are records only, served by one agents' process.

A benchmark and test tool (docs/capacity.md): it runs no code. It lets the real api,
controller, Redis scripts, session reaper and reconciliation carry 100,000 live sessions
on one machine, so what they cost at scale can be measured apart from what sandboxes cost.

The provider's table (what `list` answers) lives here; the agent protocol is answered by a
child process (`process.py`) that this provider tells of every sandbox before `create`
returns. A controller's restart ends that process and so every simulated sandbox; the next
leader's reconciliation then releases their sessions as dead, as after a crash of the local
provider's zygote.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket

from sandpool.controller.provider import LostListener, PoolSpec, ProviderError, SandboxInfo
from sandpool.providers.simulated.process import AgentsProcess, ProcessGone
from sandpool.providers.simulated.settings import SimulatedProviderSettings

log = logging.getLogger(__name__)

WARNING = ("SIMULATED PROVIDER: no sandbox runs and no code is executed; every Execute answers a fixed "
           "result. For benchmarks and tests of the control plane only (docs/capacity.md)")


class SimulatedProvider:
    name = "simulated"

    def __init__(self, settings: SimulatedProviderSettings) -> None:
        self.settings = settings
        self.sandboxes: dict[str, SandboxInfo] = {}
        self.address = ""
        self._agents = AgentsProcess(settings)
        self._lost: LostListener | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        log.warning(WARNING)
        s = self.settings
        sock = socket.socket(socket.AF_INET6 if ":" in s.simulated_host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((s.simulated_host, s.simulated_port))
            sock.listen(2048)
        except OSError as exc:
            sock.close()
            raise ProviderError(f"the simulated agents cannot listen on {s.simulated_host}:{s.simulated_port}: "
                                f"{exc.strerror}", transient=False) from None
        port = sock.getsockname()[1]
        host = f"[{s.simulated_host}]" if ":" in s.simulated_host else s.simulated_host
        try:
            await self._agents.start(sock)
        except (ProcessGone, OSError) as exc:
            raise ProviderError(str(exc), transient=False) from None
        self.address = f"http://{host}:{port}"
        self._watch = asyncio.create_task(self._watch_agents(), name="simulated-agents-watch")
        log.warning("simulated agents serving", extra={"address": self.address})

    async def _watch_agents(self) -> None:
        """The agents' process ending before `close` ends every simulated sandbox: say so, and tell the
        controller each is lost (its sessions are released, its waiters served elsewhere), as when a
        zygote dies; creates fail from then on."""
        status = await self._agents.exited()
        self.address = ""
        lost, self.sandboxes = list(self.sandboxes), {}
        log.error("the simulated agents' process ended; every simulated sandbox is lost",
                  extra={"exit_status": status, "sandboxes": len(lost)})
        if self._lost is not None:
            for sandbox_id in lost:
                self._lost(sandbox_id, "failed")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        await self._agents.close()
        self.address = ""

    async def create(self, pool: PoolSpec, sandbox_id: str) -> SandboxInfo:
        if not self.address:
            raise ProviderError("the simulated provider is not started")
        # In the table before the agents' process is told: a create abandoned meanwhile leaves a sandbox
        # that `list` shows (reconciliation destroys it), never one only the agents' process knows.
        info = self.sandboxes[sandbox_id] = SandboxInfo(sandbox_id=sandbox_id, pool=pool.name, address=self.address,
                                                         secret=secrets.token_urlsafe(24), ready=True)
        try:
            await self._agents.add(sandbox_id, str(info.secret))
        except ProcessGone as exc:
            self.sandboxes.pop(sandbox_id, None)
            raise ProviderError(str(exc)) from None
        return info

    async def destroy(self, sandbox_id: str) -> None:
        self.sandboxes.pop(sandbox_id, None)
        if not self.address:
            return  # the agents' process is gone, and every sandbox with it
        try:
            await self._agents.remove(sandbox_id)  # told even of one not in the table: it forgets what it has
        except ProcessGone as exc:
            raise ProviderError(str(exc)) from None

    async def list(self) -> list[SandboxInfo]:
        return list(self.sandboxes.values())

    def describe(self) -> dict[str, object]:
        return {"provider": self.name, "simulated": True, "runs_code": False, "address": self.address,
                "sandboxes": len(self.sandboxes),
                "exec_delay_seconds": self.settings.simulated_exec_delay_seconds}

    def on_lost(self, listener: LostListener) -> None:
        """Told of every simulated sandbox when the agents' process ends on its own (none dies alone)."""
        self._lost = listener
