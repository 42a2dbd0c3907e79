"""The persistent bash shell: cwd and exported variables carry over between calls.

Commands are fed NUL-terminated on a dedicated fd and run with `eval`; the
status comes back on another fd. Unbalanced quotes or a heredoc without its end
in a command therefore cannot desynchronise the framing: `eval` sees the whole
command as one string and fails it as a syntax error. Each command's stdin is
/dev/null. fds 1 and 2 are put back after every command (the loop keeps copies),
so `exec >&-` or `exec 2>file` cannot cut later commands' output off. A command
that runs `exit` ends the shell: its status is reported
and a new shell takes over (the result says so).

The `INT` trap keeps the shell alive when a timeout interrupts the command it
is running (bash would otherwise exit with its child), so cwd and variables
survive an interrupted call; a `read` interrupted by a late SIGINT resumes.

The loop calls no command a session's function could stand in for: the
classic fork bomb `:(){ :|:& };:` redefines `:`, which a `while :` loop would
then run before every call. It uses keywords (`while (( 1 ))`), an assignment
as its trap, and `builtin ...`, after removing any function named `builtin`
with `unset` in POSIX mode (where special builtins come before functions).
"""

from __future__ import annotations

import asyncio
import logging
import subprocess

from sandpool.agent import procs
from sandpool.agent.execution import ChildStartFailed, PersistentChild
from sandpool.agent.worker import Worker, WorkerDied

LOOP = r"""
trap '__sandpool_interrupted=1' INT
__sandpool_in=$1; __sandpool_out=$2; __sandpool_seq=0; shift 2
exec {__sandpool_stdout}>&1 {__sandpool_stderr}>&2
while (( 1 )); do
  POSIXLY_CORRECT=1; unset -f builtin; unset POSIXLY_CORRECT
  IFS= builtin read -r -d '' __sandpool_cmd <&"$__sandpool_in"
  __sandpool_rc=$?
  if (( __sandpool_rc > 128 )); then builtin continue; fi
  if (( __sandpool_rc != 0 )); then builtin break; fi
  (( __sandpool_seq += 1 ))
  builtin eval "$__sandpool_cmd" </dev/null
  __sandpool_rc=$?
  POSIXLY_CORRECT=1; unset -f builtin; exec 1>&"$__sandpool_stdout" 2>&"$__sandpool_stderr"
  unset POSIXLY_CORRECT
  builtin printf '%d %d\n' "$__sandpool_seq" "$__sandpool_rc" >&"$__sandpool_out"
done
"""

START_TIMEOUT_SECONDS = 10.0
log = logging.getLogger("sandpool.agent.shell")


def parse_line(buf: bytearray) -> bytes | None:
    end = buf.find(b"\n")
    if end < 0:
        if len(buf) > 64:
            raise ValueError("garbled status line")
        return None
    line = bytes(buf[:end])
    del buf[:end + 1]
    return line


class Shell(PersistentChild):
    kind = "shell"

    def __init__(self, *, bash: str, workspace: str, env: dict[str, str], preexec,
                 child_reaper: procs.ChildReaper, max_output_bytes: int, grace_seconds: float) -> None:
        super().__init__(max_output_bytes=max_output_bytes, grace_seconds=grace_seconds)
        self._bash = bash
        self._workspace = workspace
        self._env = env
        self._preexec = preexec
        self._child_reaper = child_reaper

    async def new_worker(self) -> Worker:
        worker = Worker("shell", [self._bash, "--noprofile", "--norc", "-c", LOOP, "sandpool-shell"],
                        cwd=self._workspace, env=self._env, preexec=self._preexec, child_reaper=self._child_reaper,
                        parse_event=parse_line)
        try:
            worker.spawn()
        except (OSError, subprocess.SubprocessError):
            log.exception("cannot start the shell")
            raise ChildStartFailed("the shell failed to start") from None
        try:
            worker.seq = 1
            await worker.send(self.encode_request(":", 1))
            await asyncio.wait_for(self._completion(worker, 1), START_TIMEOUT_SECONDS)
        except (TimeoutError, WorkerDied):
            await worker.close()
            raise ChildStartFailed("the shell failed to start") from None
        return worker

    def encode_request(self, text: str, seq: int) -> bytes:
        return text.encode("utf-8", errors="surrogatepass") + b"\0"

    def decode_completion(self, event: bytes) -> tuple[int, int]:
        seq, code = event.decode("ascii").split()
        return int(seq), int(code)
