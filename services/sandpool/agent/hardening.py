"""What the interpreter and shell children do to themselves between fork and exec.

Order matters and must stay: join the code's process-capped cgroup (while still
root, and before anything else could fork); drop supplementary groups, then the
gid, then the uid (a uid drop first would forbid the others); then `PR_SET_NO_NEW_PRIVS` so no
set-uid binary can win privileges back; then resource limits; then the seccomp
filter last, because it may forbid the calls above (none where the agent runs under
that very filter already, installed by the zygote: the child is under it from its
fork, and a second copy refuses nothing more; agent/seccomp.py). Runs in the forked
child (`preexec_fn`), so it touches only what was imported before the fork.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandpool.agent import procs, seccomp
from sandpool.agent.settings import AgentSettings

NPROC_ABOVE_CGROUP = 32

log = logging.getLogger("sandpool.agent")

SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# What a matplotlib font cache is made of (`fontlist-v<FontManager version>.json`).
MATPLOTLIB_CACHE_GLOB = "fontlist-v*.json"
_MATPLOTLIB_CACHE_AFFIXES = ("fontlist-v", ".json")


@dataclass(frozen=True)
class ChildPolicy:
    uid: int | None
    gid: int | None
    nproc: int | None
    nofile: int | None
    fsize: int | None
    address_space: int | None

    @classmethod
    def from_settings(cls, settings: AgentSettings) -> ChildPolicy:
        dropping = settings.sandbox_uid is not None and os.geteuid() == 0
        nproc = settings.rlimit_nproc if dropping else None  # NPROC counts per uid: only for a uid of its own
        if nproc is not None and settings.code_cgroup_fd is not None and settings.process_cap:
            # The cgroup's cap must be the one that fires: it records the hit (pids.events), which
            # is how the agent knows to kill what the call started. RLIMIT_NPROC stays a backstop.
            nproc = max(nproc, settings.process_cap + NPROC_ABOVE_CGROUP)
        return cls(
            uid=settings.sandbox_uid if dropping else None,
            gid=settings.effective_gid() if dropping else None,
            nproc=nproc,
            nofile=settings.rlimit_nofile,
            fsize=settings.rlimit_fsize_bytes,
            address_space=settings.rlimit_as_bytes,
        )

    @property
    def drops_privileges(self) -> bool:
        return self.uid is not None


def _within_hard(which: int, value: int) -> int:
    """`value`, lowered to this process's hard limit (which a child inherits and cannot raise)."""
    _, hard = resource.getrlimit(which)
    return min(value, hard) if hard != resource.RLIM_INFINITY else value


def _limit(which: int, value: int | None) -> None:
    if value is None:
        return
    value = _within_hard(which, value)
    resource.setrlimit(which, (value, value))


def apply(policy: ChildPolicy, cgroup_join_fd: int = -1) -> None:
    """Harden the calling process; raises (and so fails the spawn) if a step that was asked for fails.

    `cgroup_join_fd`: the live generation's `tasks`/`cgroup.procs`, opened by the agent; writing
    "0" moves this (single-threaded, just forked) process there. A child that cannot join does
    not start: it would run outside the process cap.
    """
    if cgroup_join_fd >= 0:
        os.write(cgroup_join_fd, b"0")
    if policy.uid is not None:
        gid = policy.gid if policy.gid is not None else policy.uid
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(policy.uid, policy.uid, policy.uid)
        if os.geteuid() != policy.uid or os.getegid() != gid:
            raise OSError("privilege drop did not take")
    if not procs.prctl(procs.PR_SET_NO_NEW_PRIVS, 1):
        raise OSError("PR_SET_NO_NEW_PRIVS failed")
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NPROC, policy.nproc)
    _limit(resource.RLIMIT_NOFILE, policy.nofile)
    _limit(resource.RLIMIT_FSIZE, policy.fsize)
    _limit(resource.RLIMIT_AS, policy.address_space)
    if not seccomp.inherited():  # under the agent's filter, this one, since the fork
        seccomp.install_filter()


def preexec(policy: ChildPolicy, cgroup_join_fd: Callable[[], int] = lambda: -1) -> Callable[[], None]:
    """The `preexec_fn` of the shell; `cgroup_join_fd` is asked at each fork (the live generation changes)."""
    procs.libc()  # loaded here, in the parent, before any fork
    return lambda: apply(policy, cgroup_join_fd())


@dataclass(frozen=True)
class SelfHardening:
    """`apply`, done by the runner to itself in its first lines, so the agent can start it without
    a `preexec_fn`: Python then spawns it with vfork (~0.6 ms of CPU) instead of forking the whole
    agent and running Python in the child (~4-5 ms).

    Only when the runner drops to a uid of its own (`self_hardening` says None otherwise): until the
    drop it runs as the agent's user, which sandboxed code cannot touch; from the drop to its last
    step it is not dumpable, so nothing of the sandbox uid can write into it before it is hardened.
    It runs only `python -I` start-up and its own source until then, and exits if any step fails.
    The agent moves it into the code cgroup itself, at once (`CodeCgroup.adopt`), and does not take
    its word for the rest: `verify` reads the result from /proc before the first call.
    """

    policy: ChildPolicy
    seccomp_program: bytes
    inherited: bool = False
    """The runner is under `seccomp_program` from its start and is not asked to add it again: the
    agent runs under it (installed by the zygote: `seccomp.inherited`), so an exec'd runner
    inherits it, and a runner of the zygote's template has it from the template's confinement,
    installed before it says its pid (agent/runner_template.py). `verify` then wants exactly the
    agent's filters, where it otherwise wants one more, the runner's own."""

    def argv(self) -> list[str]:
        """`--harden` and its spec: `key=value` pairs; absent keys are steps not asked for."""
        p = self.policy
        fields = {"uid": p.uid, "gid": p.gid if p.gid is not None else p.uid, "nproc": p.nproc,
                  "nofile": p.nofile, "fsize": p.fsize, "as": p.address_space,
                  "seccomp": None if self.inherited else self.seccomp_program.hex() or None}
        return ["--harden", ",".join(f"{key}={value}" for key, value in fields.items() if value is not None)]

    def verify(self, pid: int) -> None:
        """Raise HardeningFailed unless /proc shows process `pid` hardened as asked."""
        status, own = _proc_status(str(pid)), _proc_status("self")
        uid = self.policy.uid
        gid = self.policy.gid if self.policy.gid is not None else uid
        wanted = {"Uid": [str(uid)] * 4, "Gid": [str(gid)] * 4, "Groups": [], "NoNewPrivs": ["1"],
                  "CapPrm": ["0" * 16], "CapEff": ["0" * 16]}
        if self.seccomp_program:
            wanted["Seccomp"] = ["2"]
            if "Seccomp_filters" in own:  # its own filter on top of the agent's, unless the agent's is it
                wanted["Seccomp_filters"] = [str(int(own["Seccomp_filters"][0]) + (0 if self.inherited else 1))]
        differs = [f"{name} is {status.get(name)}, not {values}" for name, values in wanted.items()
                   if status.get(name) != values]
        limits = _proc_limits(pid)
        for name, which, value in (("core", resource.RLIMIT_CORE, 0), ("nproc", resource.RLIMIT_NPROC,
                                   self.policy.nproc), ("nofile", resource.RLIMIT_NOFILE, self.policy.nofile),
                                   ("fsize", resource.RLIMIT_FSIZE, self.policy.fsize),
                                   ("as", resource.RLIMIT_AS, self.policy.address_space)):
            if value is None:
                continue
            expected = _within_hard(which, value)  # the runner inherited the agent's hard limits
            if limits.get(name) != (expected, expected):
                differs.append(f"limit {name} is {limits.get(name)}, not {(expected, expected)}")
        if differs:
            raise HardeningFailed("; ".join(differs))


def check_cgroups(pid: int, *, code_cgroup: bool) -> None:
    """Raise HardeningFailed unless process `pid` is in this agent's own groups in every v1
    hierarchy but `pids`, and inside the agent's cgroup namespace in the v2 one (the code cgroup
    there and in v1 `pids` when there is one, which `CodeCgroup.adopt` checks by moving it; the
    agent's own group when there is none). For a runner the zygote's template forked in from
    outside: one that missed joining the agent's groups would run outside the sandbox's limits."""
    def groups(who: str) -> dict[str, str]:
        found = {}
        with open(f"/proc/{who}/cgroup") as lines:
            for line in lines:
                _number, controllers, path = line.rstrip("\n").split(":", 2)
                if not code_cgroup or "pids" not in controllers.split(","):
                    found[controllers] = path
        return found

    try:
        theirs, ours = groups(str(pid)), groups("self")
    except (OSError, ValueError) as exc:
        raise HardeningFailed(f"cannot read the cgroups of {pid}: {exc}") from None
    if code_cgroup:
        unified = theirs.pop("", "/")
        ours.pop("", None)
        if unified.startswith("/.."):  # shown relative to the agent's cgroup namespace
            raise HardeningFailed(f"in cgroup {unified}, outside the sandbox")
    if theirs != ours:
        raise HardeningFailed(f"in cgroups {theirs}, not the agent's {ours}")


class HardeningFailed(Exception):
    """A child is not hardened as its policy says; it must not run code."""


def self_hardening(policy: ChildPolicy, python: str) -> SelfHardening | None:
    """What the runner started with `python` is asked to do to itself, or None when it is hardened
    by a `preexec_fn`.

    None without a uid drop: the runner would then share sandboxed code's uid from its exec and be
    open to it (a process an earlier call left running could write into its memory) until it had
    hardened itself. None unless the agent itself runs under a seccomp filter (the zygote's layer):
    only then is the kernel known to take one, so the runner's filter (the one `apply` installs,
    which tolerates a refusal) can be required of it. None where `verify` cannot look (/proc of
    another PID namespace; no `Seccomp_filters`, before Linux 5.9, to tell the runner's own filter
    from the inherited one), and for an interpreter that is not a binary (`is_binary`).
    """
    arch = seccomp.native_arch()
    if not policy.drops_privileges or arch is None or not procs.proc_matches_this_namespace():
        return None
    own = _proc_status("self")
    if own.get("Seccomp") != ["2"] or "Seccomp_filters" not in own or not is_binary(python):
        return None
    return SelfHardening(policy, seccomp.program_bytes(arch), inherited=seccomp.inherited())


def is_binary(path: str) -> bool:
    """Whether `path` is an executable file in ELF format, not a script (a pyenv shim reads the
    working directory, the workspace): only such an interpreter may start a self-hardening runner."""
    try:
        with open(path, "rb") as program:
            return program.read(4) == b"\x7fELF" and os.access(path, os.X_OK)
    except OSError:
        return False


_LIMIT_NAMES = {"Max core file size": "core", "Max processes": "nproc", "Max open files": "nofile",
                "Max file size": "fsize", "Max address space": "as"}


def _proc_status(pid: str) -> dict[str, list[str]]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            return {name: value.split() for name, _, value in (line.partition(":") for line in status)}
    except OSError as exc:
        raise HardeningFailed(f"cannot read the status of process {pid}: {exc.strerror}") from None


def _proc_limits(pid: int) -> dict[str, tuple[int, int]]:
    """/proc/<pid>/limits as name -> (soft, hard), RLIM_INFINITY for "unlimited"."""
    try:
        with open(f"/proc/{pid}/limits", encoding="ascii", errors="replace") as limits:
            lines = limits.read().splitlines()
    except OSError as exc:
        raise HardeningFailed(f"cannot read the limits of process {pid}: {exc.strerror}") from None
    found = {}
    for line in lines:
        name = _LIMIT_NAMES.get(line[:25].strip())
        if name is not None:
            soft, hard = (resource.RLIM_INFINITY if v == "unlimited" else int(v) for v in line[25:].split()[:2])
            found[name] = (soft, hard)
    return found


def child_path(python: str) -> str:
    """PATH of sandboxed code: the sandbox interpreter's own directory, then the standard system ones.

    The interpreter's directory (a venv's `bin`, never resolved through its symlink) makes
    `python`, `pip` and the environment's console scripts in bash the ones sandboxed Python
    code runs with, not the base system's. A bare command name adds nothing.
    """
    head = [os.path.dirname(os.path.abspath(python))] if os.sep in python else []
    return os.pathsep.join(dict.fromkeys([*head, *SYSTEM_PATH]))


def child_env(workspace: str, *, python: str, mplconfigdir: str | None = None) -> dict[str, str]:
    """A clean environment: nothing of the agent's (no SANDPOOL_*, no secret) reaches sandboxed code.

    `python` is the interpreter that runs sandboxed code (its directory leads PATH);
    `mplconfigdir` is matplotlib's private config and cache directory (see `matplotlib_dir`).
    """
    env = {
        "HOME": workspace,
        "PWD": workspace,
        "PATH": child_path(python),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "MPLBACKEND": "Agg",
        "TERM": "dumb",
    }
    if mplconfigdir is not None:
        env["MPLCONFIGDIR"] = mplconfigdir
    return env


def matplotlib_dir(seed: Path | None, policy: ChildPolicy) -> str | None:
    """A private, writable MPLCONFIGDIR for sandboxed code, in the agent's temporary directory.

    matplotlib insists on a writable config and cache directory: without MPLCONFIGDIR it
    writes under $HOME, the workspace (files the user did not make), and given an unwritable
    one it makes a temporary directory and warns on stderr. The temporary directory is the
    sandbox's own (`TMPDIR`, the pod's /tmp volume; a private /tmp locally, or the sandbox
    directory's `tmp` when the sandbox has no root of its own), never the workspace. A font
    cache found in `seed` (`fontlist-v*.json`, pre-built in the image) is copied in, so the
    first `import matplotlib.pyplot` reads it instead of rebuilding it (0.17 s in the sandbox
    image, which has only matplotlib's own fonts; more with system fonts). None when no
    directory can be made: matplotlib then falls back by itself.
    """
    path = None
    # The temp dir found at start may be a host path a sandbox root does not have: /tmp then.
    for where in dict.fromkeys((tempfile.gettempdir(), "/tmp")):  # the sandbox's own /tmp
        try:
            path = Path(tempfile.mkdtemp(prefix="sandpool-mpl-", dir=where))
            break
        except OSError as exc:
            error = exc.strerror
    if path is None:
        log.warning("no private matplotlib directory (%s): matplotlib will make its own", error)
        return None
    copied = []
    if seed is not None:
        for cache in _font_caches(Path(seed)):
            try:
                shutil.copyfile(cache, path / cache.name)
                copied.append(path / cache.name)
            except OSError as exc:
                log.warning("cannot copy the matplotlib font cache %s: %s", cache.name, exc.strerror)
    if policy.uid is not None:  # the agent is root and drops: the directory is the sandbox uid's
        gid = policy.gid if policy.gid is not None else policy.uid
        for entry in (path, *copied):
            os.chown(entry, policy.uid, gid)
    return str(path)


def _font_caches(seed: Path) -> list[Path]:
    """The `MATPLOTLIB_CACHE_GLOB` files in `seed`, sorted. Matched by prefix and suffix, not by
    `Path.glob`: that compiles its pattern into a regex in every sandbox, ~0.3 ms of a fresh agent's start."""
    prefix, suffix = _MATPLOTLIB_CACHE_AFFIXES
    try:
        names = os.listdir(seed)
    except OSError:
        return []
    return [seed / name for name in sorted(names)
            if name.startswith(prefix) and name.endswith(suffix) and len(name) >= len(prefix) + len(suffix)
            and (seed / name).is_file()]


def prepare_workspace(path: str, policy: ChildPolicy) -> None:
    """Make the workspace writable by the sandbox uid (the agent runs as root when it drops)."""
    if policy.uid is None:
        return
    gid = policy.gid if policy.gid is not None else policy.uid
    os.chown(path, policy.uid, gid)
    os.chmod(path, 0o700)
