"""The simulated agents' process: the agent protocol for every simulated sandbox, apart from the controller.

The controller starts it (`AgentsProcess.start`), hands it the listening socket and tells it,
one line at a time on its stdin, which sandboxes exist; it answers each line on its stdout
once the change is in force, so a sandbox `create` returned is one the server already knows:

    add <sandbox_id> <secret>      ->  ok
    remove <sandbox_id>            ->  ok

Why a process of its own: in the controller's event loop the agents' answers waited behind
whatever the controller was doing (at 100,000 sandboxes a reconciliation pass parses every
record), so a benchmark measured the controller's pauses as Execute latency, which real
agents (processes of their own) never see. It exits when its stdin closes: the controller
ended, however it ended, and every simulated sandbox ends with it, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn

from sandpool.providers.simulated.files import MemoryWorkspace
from sandpool.providers.simulated.server import SimulatedAgents, SimulatedSandbox
from sandpool.providers.simulated.settings import SimulatedProviderSettings

log = logging.getLogger(__name__)

KEEP_ALIVE_SECONDS = 30
"""How long the server keeps an idle connection: well past the api's own idle retirement (4 s,
`core.hop`), so on a starved machine the api never sends a call on a connection the server is closing
(every simulated sandbox shares the server's connections: one such race would fail whichever
session's call it carried)."""

START_SECONDS = 30.0
READY, OK = b"ready\n", b"ok\n"


class ProcessGone(Exception):
    """The agents' process ended or answered out of protocol: every simulated sandbox is gone."""


class AgentsProcess:
    """The controller's side: start the process, tell it of sandboxes, end it."""

    def __init__(self, settings: SimulatedProviderSettings) -> None:
        self.settings = settings
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()  # one line and its answer at a time

    async def start(self, sock: socket.socket) -> None:
        """Start serving on `sock` (already bound; the child inherits it and this process closes its copy)."""
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, str(sock.fileno()), self.settings.model_dump_json(),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, pass_fds=(sock.fileno(),))
        finally:
            sock.close()
        assert self._process.stdout is not None
        try:
            line = await asyncio.wait_for(self._process.stdout.readline(), START_SECONDS)
        except TimeoutError:
            line = b""
        if line != READY:
            await self.close()
            raise ProcessGone("the simulated agents' process did not start (its log says why)")

    async def add(self, sandbox_id: str, secret: str) -> None:
        await self._tell(f"add {sandbox_id} {secret}\n")

    async def remove(self, sandbox_id: str) -> None:
        await self._tell(f"remove {sandbox_id}\n")

    async def _tell(self, line: str) -> None:
        process = self._process
        if process is None or process.stdin is None or process.stdout is None:
            raise ProcessGone("the simulated agents' process is not running")
        # Shielded: a caller cancelled between its line and its answer (a create abandoned at step-down)
        # must not leave that answer to be read as the next caller's.
        answer = await asyncio.shield(self._exchange(process, line.encode()))
        if answer != OK:
            raise ProcessGone(f"the simulated agents' process is gone (exit status {process.returncode})")

    async def _exchange(self, process: asyncio.subprocess.Process, line: bytes) -> bytes:
        assert process.stdin is not None and process.stdout is not None
        async with self._lock:
            try:
                process.stdin.write(line)
                await process.stdin.drain()
                return await process.stdout.readline()
            except (OSError, ConnectionError):
                return b""

    async def exited(self) -> int:
        """Wait until the process ends (for whatever reason); its exit status."""
        if self._process is None:
            raise ProcessGone("the simulated agents' process is not running")
        return await self._process.wait()

    async def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()  # its cue to end
        try:
            await asyncio.wait_for(process.wait(), 5)
        except TimeoutError:
            process.kill()
            await process.wait()


# --- the child ---------------------------------------------------------------------------------

class _Server(uvicorn.Server):
    """Ends when its stdin closes, not on signals: the controller's group gets those, and ends it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve(fd: int, settings: SimulatedProviderSettings) -> None:
    agents = SimulatedAgents(settings)
    server = _Server(uvicorn.Config(agents, lifespan="off", http="httptools", access_log=False,
                                    log_level="warning", backlog=2048, timeout_keep_alive=KEEP_ALIVE_SECONDS))
    serving = asyncio.create_task(server.serve(sockets=[socket.socket(fileno=fd)]), name="simulated-agents")
    while not server.started:
        if serving.done():
            return
        await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    out.write(READY)
    out.flush()
    sandboxes: dict[str, SimulatedSandbox] = {}
    while line := await reader.readline():
        match line.decode().split():
            case ["add", sandbox_id, secret]:
                if (earlier := sandboxes.get(sandbox_id)) is not None:
                    agents.remove(earlier)  # added again: only the latest secret opens it
                sandbox = SimulatedSandbox(sandbox_id, secret,
                                           MemoryWorkspace(max_bytes=settings.simulated_max_workspace_bytes))
                sandboxes[sandbox_id] = sandbox
                agents.add(sandbox)
            case ["remove", sandbox_id]:
                if (gone := sandboxes.pop(sandbox_id, None)) is not None:
                    agents.remove(gone)
            case _:
                log.error("the simulated agents' process got a line out of protocol; it ends")
                break
        out.write(OK)  # a blocking write of 3 bytes to a pipe the controller reads at once
        out.flush()
    server.should_exit = True
    await asyncio.wait({serving}, timeout=5)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C reaches the controller, which ends this
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s simulated-agents %(levelname)s %(message)s")
    fd, settings = int(sys.argv[1]), SimulatedProviderSettings.model_validate_json(sys.argv[2])
    os.set_inheritable(fd, False)
    asyncio.run(_serve(fd, settings))


if __name__ == "__main__":
    main()
