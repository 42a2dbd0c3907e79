"""The persistent Python interpreter: a warmed runner process, plus a warmed spare.

Why a separate process started with `python -I -u -c <runner source>` rather than a fork
of the agent: the runner imports only the standard library, so a cold start
costs about as much as the interpreter's own start-up (~20-30 ms, measured in
bench/agent_bench.py), it carries none of the agent's memory (no secret, no
FastAPI), and it can be started at any time, also after the event loop runs.
It hardens itself in its first lines (agent/hardening.py: SelfHardening), so the
agent spawns it with vfork rather than a fork of its own ~60 MB, and checks the
result in /proc. It is started and warmed before the agent answers its first
request, so the first call is as fast as the tenth; a spare is kept warm so a
restart after a timeout costs nothing on the next call.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from sandpool.agent import hardening, procs
from sandpool.agent.execution import ChildStartFailed, PersistentChild
from sandpool.agent.hardening import HardeningFailed, SelfHardening
from sandpool.agent.template_channel import TemplateChannel
from sandpool.agent.worker import Worker, WorkerDied

log = logging.getLogger("sandpool.agent.interpreter")

RUNNER = Path(__file__).with_name("runner.py")
TEMPLATE = Path(__file__).with_name("runner_template.py")


@functools.cache
def runner_source() -> str:
    """The runner's source, handed to the interpreter with `-c`.

    Not its path: the sandbox uid may not be able to traverse to where sandpool is
    installed (a checkout under a 0700 home), and the source is public anyway.
    """
    return RUNNER.read_text()


def template_source() -> str:
    """A runner template's source: the runner's, then the template's (agent/runner_template.py)."""
    return runner_source() + "\n" + TEMPLATE.read_text()


_HEADER = struct.Struct(">I")
START_TIMEOUT_SECONDS = 30.0
TEMPLATE_TIMEOUT_SECONDS = 3.0
"""How long a runner from the zygote's template may take to say its pid before the agent uses exec."""
REAP_TIMEOUT_SECONDS = 5.0


class TemplateUnavailable(Exception):
    """The zygote's runner template did not start a runner; the agent falls back to exec."""


def parse_frame(buf: bytearray) -> bytes | None:
    if len(buf) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack_from(buf)
    if size > 1 << 20:
        raise ValueError("oversized control frame")
    if len(buf) < _HEADER.size + size:
        return None
    body = bytes(buf[_HEADER.size:_HEADER.size + size])
    del buf[:_HEADER.size + size]
    return body


class Interpreter(PersistentChild):
    kind = "interpreter"

    def __init__(self, *, python: str | None, workspace: str, env: dict[str, str], preexec: Callable[[], None],
                 harden: SelfHardening | None, child_reaper: procs.ChildReaper,
                 max_output_bytes: int, grace_seconds: float, spare: bool, preimport: tuple[str, ...] = (),
                 template: TemplateChannel | None = None) -> None:
        super().__init__(max_output_bytes=max_output_bytes, grace_seconds=grace_seconds)
        self._python = python or sys.executable
        self._workspace = workspace
        self._env = env
        self._preexec = preexec
        self._harden = harden
        self._child_reaper = child_reaper
        self._want_spare = spare
        self._options = ["--preimport", ",".join(preimport)] if preimport else []
        self._spare: asyncio.Task[Worker] | None = None
        self._template = template

    async def new_worker(self) -> Worker:
        harden = self._harden  # None: hardened between fork and exec by `preexec` instead
        if harden is not None and self._template is not None and self._template.usable:
            try:
                return await self._worker_from_template(self._template, harden)
            except TemplateUnavailable as exc:
                log.warning("the runner template did not start a runner (%s); starting runners with exec", exc)
                self._template.stop_requests()
        # A self-hardening runner runs its environment's site start-up only once hardened (-S, then site.main()).
        flags = ["-I", "-S", "-u"] if harden else ["-I", "-u"]
        argv = [self._python, *flags, "-c", runner_source(), *self._options, *(harden.argv() if harden else [])]
        worker = Worker("interpreter", argv, cwd=self._workspace, env=self._env,
                        preexec=None if harden else self._preexec, child_reaper=self._child_reaper,
                        parse_event=parse_frame)
        try:
            worker.spawn()
            if harden is not None and self.cap is not None:
                self.cap.adopt(worker.pid)  # before any await: no generation change can come between
        except (OSError, subprocess.SubprocessError):
            log.exception("cannot start the Python interpreter")
            if worker.proc is not None:
                await worker.close()
            raise ChildStartFailed("the Python interpreter failed to start") from None
        return await self._until_ready(worker, harden)

    async def _worker_from_template(self, template: TemplateChannel, harden: SelfHardening) -> Worker:
        """A runner forked by the zygote's template: it says its pid, the agent moves it into the
        code cgroup, and only then sends it its set-up (it hardens itself with `harden` as an exec'd
        runner does, and is verified the same way, and its cgroups against the agent's). Any
        failure closes it and raises TemplateUnavailable: the caller starts one with exec instead."""
        worker = Worker("interpreter", [], cwd=self._workspace, env=self._env, preexec=None,
                        child_reaper=self._child_reaper, parse_event=parse_frame)
        try:
            worker.spawn_from(template)
        except OSError as exc:
            raise TemplateUnavailable(str(exc)) from None
        try:
            event = json.loads(await worker.next_event(TEMPLATE_TIMEOUT_SECONDS))
            if event.get("event") != "spawned":
                raise ValueError("no spawned event")
            worker.adopt(int(event["pid"]), own_child=False)
            if self.cap is not None:
                self.cap.adopt(worker.pid)  # before it reads its set-up: it runs nothing of the sandbox's yet
            hardening.check_cgroups(worker.pid, code_cgroup=self.cap is not None)
            setup = json.dumps({"env": self._env, "cwd": self._workspace,
                                "argv": [*self._options, *harden.argv()]}).encode()
            await worker.send(_HEADER.pack(len(setup)) + setup)
            return await self._until_ready(worker, harden)
        except ChildStartFailed as exc:  # `_until_ready` closed it already
            raise TemplateUnavailable(str(exc)) from None
        except (TimeoutError, WorkerDied, ValueError, KeyError, TypeError, AttributeError, OSError,
                HardeningFailed) as exc:
            await worker.close()
            raise TemplateUnavailable(f"{type(exc).__name__}: {exc}") from None

    async def _until_ready(self, worker: Worker, harden: SelfHardening | None) -> Worker:
        try:
            event = json.loads(await worker.next_event(START_TIMEOUT_SECONDS))
            if event.get("event") != "ready":
                raise ValueError("interpreter did not report ready")
            if harden is not None:
                harden.verify(worker.pid)
        except HardeningFailed as exc:
            log.error("the Python interpreter is not hardened as asked: %s", exc)
            await worker.close()
            raise ChildStartFailed("the Python interpreter failed to start") from None
        except (TimeoutError, WorkerDied, ValueError, OSError):
            await worker.close()
            raise ChildStartFailed("the Python interpreter failed to start") from None
        return worker

    def start_spare(self) -> None:
        """Start the spare in the background: only a restart needs it, so start-up does not wait for it."""
        if self._spare is None:
            self._refill_spare()

    def _refill_spare(self) -> None:
        if self._want_spare and not self._closed:
            self._spare = asyncio.create_task(self.new_worker())

    async def replacement(self) -> Worker:
        spare, self._spare = self._spare, None
        worker = None
        if spare is not None:
            try:
                worker = await spare
                if worker.dead:
                    await worker.close()
                    worker = None
            except Exception:  # noqa: BLE001 - fall back to a cold start
                worker = None
        if worker is None:
            worker = await self.new_worker()
        self._refill_spare()
        return worker

    async def close(self) -> None:
        await super().close()
        spare, self._spare = self._spare, None
        if spare is not None:
            try:
                worker = await spare
            except Exception:  # noqa: BLE001 - a spare that failed to start has nothing to close
                return
            await worker.close()

    def encode_request(self, text: str, seq: int) -> bytes:
        body = json.dumps({"id": seq, "code": text}).encode()
        return _HEADER.pack(len(body)) + body

    async def reap_killed(self, worker: Worker) -> None:
        if self.cap is None or not self.cap.killed_children or worker.dead:
            return
        worker.seq += 1
        body = json.dumps({"id": worker.seq, "reap": self.cap.take_killed_children()}).encode()
        try:
            await worker.send(_HEADER.pack(len(body)) + body)
            await asyncio.wait_for(self._completion(worker, worker.seq), REAP_TIMEOUT_SECONDS)
        except (TimeoutError, WorkerDied):
            log.warning("the interpreter did not reap the processes the process cap killed")
            worker.kill()  # replaced at the next call

    def decode_completion(self, event: bytes) -> tuple[int, int]:
        message = json.loads(event)
        if message.get("event") != "done":
            raise ValueError("unexpected interpreter event")
        return int(message["id"]), int(message["return_code"])
