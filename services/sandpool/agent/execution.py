"""Running one call in a persistent child: deadline, interrupt, kill, restart.

Shared by the Python interpreter and the shell. Past the deadline the child's
process group gets SIGINT (the program may clean up and the child's state
survives); if it has not finished after the grace period, the child and every
process it started are killed and a fresh child takes its place, and the
result says the state was lost. Whatever happens, a timed-out call leaves no
process of its own behind. A cancel (`cancel()`, the agent's
`DELETE /sessions/{id}/exec`) stops the running call the same way, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from sandpool.agent.capture import StreamCapture
from sandpool.agent.process_cap import CodeCgroup
from sandpool.agent.worker import CallOutput, Worker, WorkerDied

log = logging.getLogger("sandpool.agent.execution")

TIMEOUT_RETURN_CODE = 124
CANCEL_RETURN_CODE = 130
"""What a cancelled call reports (128 + SIGINT, as a shell does for an interrupted command)."""

OutputListener = Callable[[str, bytes], None]
"""Gets ("stdout" | "stderr", kept bytes) as a running call's output arrives (what the result keeps)."""


class _Stopped(Exception):
    """A cancel asked the running call to stop."""


class ChildStartFailed(RuntimeError):
    """The interpreter or shell could not be (re)started: the call cannot run at all."""


@dataclass
class ExecOutcome:
    stdout: str
    stderr: str
    return_code: int
    timed_out: bool = False
    output_truncated: bool = False
    restarted: bool = False
    """The child's state was lost during this call (it timed out hard, crashed or exited)."""
    fresh: bool = False
    """This call started in a new child because the previous one's state was lost."""
    process_cap_hit: bool = False
    """A fork of this call failed at the sandbox's process cap; what the call started was killed."""
    cancelled: bool = False
    """A cancel stopped the call (interrupted, or killed when it did not stop in time)."""

    @property
    def limit(self) -> str | None:
        if self.timed_out:
            return "timeout"
        if self.process_cap_hit:
            return "processes"
        if self.output_truncated:
            return "output"
        return None


class PersistentChild:
    """Base of the interpreter and the shell: owns the current worker and replaces it when lost."""

    kind = "child"

    def __init__(self, *, max_output_bytes: int, grace_seconds: float) -> None:
        self.max_output_bytes = max_output_bytes
        self.grace_seconds = grace_seconds
        self.worker: Worker | None = None
        self._lost_since_last_call = False
        self._closed = False
        self._started = False
        """A worker was ever started (a child started on first use has not lost anything)."""
        self.cap: CodeCgroup | None = None
        """The code cgroup's process cap, when the sandbox has one (set by the runtime)."""
        self.keep: Callable[[], set[int]] = set
        """The agent's own children, never killed for a call (set by the runtime)."""
        self._stop: asyncio.Future[None] | None = None
        """Set while a call runs: resolving it stops the call (a cancel)."""
        self._stopped: asyncio.Future[bool] | None = None
        """Set while a call runs: resolved once it ended, True when a cancel stopped it."""

    # Subclasses: build, warm and talk to a worker.
    async def new_worker(self) -> Worker:
        raise NotImplementedError

    def encode_request(self, text: str, seq: int) -> bytes:
        raise NotImplementedError

    def decode_completion(self, event: bytes) -> tuple[int, int]:
        """(sequence number, return code) of a completion event."""
        raise NotImplementedError

    async def replacement(self) -> Worker:
        return await self.new_worker()

    async def reap_killed(self, worker: Worker) -> None:
        """Have the child reap processes the cap killed that were its own children (their
        zombies would hold slots of the cap). Only the interpreter needs to: bash reaps its own."""

    async def start(self) -> None:
        self.worker = await self.new_worker()
        self._started = True

    def stop_now(self) -> None:
        """Synchronous kill at shutdown: no restart follows."""
        self._closed = True
        if self.worker is not None:
            self.worker.kill()

    async def close(self) -> None:
        self._closed = True
        if self.worker is not None:
            await self.worker.close()

    async def _current(self) -> Worker:
        if not self._started:  # started on first use (the shell): a first start, not a restart
            await self.start()
            assert self.worker is not None
            return self.worker
        if self.worker is None or self.worker.dead or self.worker.output_lost:
            if self.worker is not None:
                await self.worker.close()
            self.worker = await self.replacement()
            self._lost_since_last_call = True
        return self.worker

    @property
    def running(self) -> bool:
        """A call is running and has not been asked to stop yet."""
        return self._stop is not None and not self._stop.done()

    async def cancel(self) -> bool:
        """Stop the running call as a timeout would (interrupt, then kill after the grace); True once it
        was stopped, False when no call was running or it finished before the stop reached it."""
        stop, stopped = self._stop, self._stopped
        if stop is None or stopped is None or stop.done():
            return False
        stop.set_result(None)
        return await asyncio.shield(stopped)

    async def run(self, text: str, timeout: float, on_output: OutputListener | None = None) -> ExecOutcome:
        loop = asyncio.get_running_loop()
        self._stop, self._stopped = loop.create_future(), loop.create_future()
        try:
            outcome = await self._run(text, timeout, on_output, self._stop)
        except BaseException:
            if not self._stopped.done():
                self._stopped.set_result(False)
            raise
        finally:
            self._stop = None
        if not self._stopped.done():
            self._stopped.set_result(outcome.cancelled)
        self._stopped = None
        return outcome

    async def _run(self, text: str, timeout: float, on_output: OutputListener | None,
                   stop: asyncio.Future[None]) -> ExecOutcome:
        worker = await self._current()
        fresh, self._lost_since_last_call = self._lost_since_last_call, False
        worker.current = None
        worker.drain_output()  # what background processes wrote between calls is not this call's output
        if on_output is None:
            out = CallOutput(StreamCapture(self.max_output_bytes), StreamCapture(self.max_output_bytes))
        else:
            out = CallOutput(StreamCapture(self.max_output_bytes, lambda kept: on_output("stdout", kept)),
                             StreamCapture(self.max_output_bytes, lambda kept: on_output("stderr", kept)))
        worker.current = out
        worker.forget_events()
        if self.cap is not None:
            self.cap.begin_call()
            await self.reap_killed(worker)
        timed_out = lost = capped = cancelled = False
        note = ""
        return_code = 0
        worker.seq += 1
        seq = worker.seq
        try:
            return_code = await self._until_done_or_stopped(self._send_and_wait(worker, text, seq), timeout, stop)
        except (TimeoutError, _Stopped) as why:
            timed_out, cancelled = isinstance(why, TimeoutError), isinstance(why, _Stopped)
            return_code, lost = await self._stop_overdue(worker, seq)
            ended = f"{'killed; ' + self.kind + ' state was lost' if lost else 'interrupted'}"
            note = (f"[sandpool: timeout: execution exceeded the {timeout:g}s limit and was {ended}]\n" if timed_out
                    else f"[sandpool: cancelled: the call was {ended}]\n")
        except WorkerDied:
            lost = True
            code = await worker.wait_exit(timeout=1.0)
            worker.kill()
            code = code if code is not None else await worker.wait_exit(timeout=1.0)
            return_code = code if code is not None else 1
            note = f"[sandpool: the {self.kind} exited with status {return_code}; a new one was started]\n"
        worker.drain_output()
        if worker.output_lost and not lost:
            lost = True
            note += f"[sandpool: the {self.kind} closed its output; a new one was started]\n"
        if self.cap is not None:
            report = await self.cap.end_call(self.keep())
            if report.hit:
                capped = True
                worker.drain_output()
                note += (f"[sandpool: process limit: this call reached the sandbox's cap of "
                         f"{self.cap.cap or 'its'} processes; the {len(report.killed or ())} processes it "
                         f"started were killed]\n")
                if not lost and not worker.dead:
                    await self.reap_killed(worker)
        if (timed_out or cancelled) and not lost:
            worker.kill_descendants()
        worker.current = None
        stderr = out.stderr.text() + note
        if lost:
            await worker.close()
            self._lost_since_last_call = True
            if not self._closed:
                try:
                    self.worker = await self.replacement()
                    self._lost_since_last_call = True
                except Exception:  # the next call retries the start
                    log.exception("could not restart the %s", self.kind)
                    self.worker = None
        if timed_out:
            return_code = TIMEOUT_RETURN_CODE
        elif cancelled:
            return_code = CANCEL_RETURN_CODE
        return ExecOutcome(stdout=out.stdout.text(), stderr=stderr, return_code=return_code,
                           timed_out=timed_out, output_truncated=out.stdout.truncated or out.stderr.truncated,
                           restarted=lost, fresh=fresh, process_cap_hit=capped, cancelled=cancelled)

    @staticmethod
    async def _until_done_or_stopped(work: Coroutine[Any, Any, int], timeout: float,
                                     stop: asyncio.Future[None]) -> int:
        """`work`'s result; TimeoutError past `timeout`, `_Stopped` when `stop` resolves first."""
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait((task, stop), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, WorkerDied):
            await task
        if stop.done():
            raise _Stopped()
        raise TimeoutError()

    async def _send_and_wait(self, worker: Worker, text: str, seq: int) -> int:
        await worker.send(self.encode_request(text, seq))
        return await self._completion(worker, seq)

    async def _completion(self, worker: Worker, seq: int) -> int:
        """The return code of request `seq`.

        Completions of earlier requests (late, or forged by the program on its
        own channel) are skipped, so the channel cannot stay out of step; a
        garbled one, or one from the future, kills the child.
        """
        while True:
            event = await worker.next_event(None)
            try:
                got, return_code = self.decode_completion(event)
            except (ValueError, TypeError, KeyError):
                got, return_code = -1, 0
            if got == seq:
                return return_code
            if not 0 < got < seq:
                log.warning("garbled completion from the %s", self.kind)
                worker.kill()
                raise WorkerDied(None)

    async def _stop_overdue(self, worker: Worker, seq: int) -> tuple[int, bool]:
        """Interrupt, then kill. Returns (the child's own code, whether its state was lost)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_seconds
        while True:
            worker.interrupt()
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                return await asyncio.wait_for(self._completion(worker, seq), min(0.2, remaining)), False
            except TimeoutError:
                continue
            except WorkerDied:
                break
        worker.kill()
        code = await worker.wait_exit(timeout=2.0)
        return (code if code is not None else 137), True
