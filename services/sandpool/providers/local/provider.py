"""The local provider: each sandbox is an agent process on this host, reached over a Unix socket.

Layout of one sandbox (everything the provider knows is on disk, so a restarted
provider lists and destroys what an earlier one started):

    <data_dir>/sandboxes/<id>/          0711 root: enterable, not listable
        meta.json                       pool, uid, gid, created_at
        secret                          0600: the agent's per-sandbox secret
        agent.pid                       "pid pgid start_time" of the agent
        agent.log                       0600: the agent's stderr
        workspace/                      0700, owned by the sandbox uid; a size-capped tmpfs when root
    <socket dir>/<id>/agent.sock        the agent's socket (address unix://...), in a short private
                                        directory of its own (`sockets.py`): any data dir path works

With `--egress-socket` (the egress proxy's Unix socket), each sandbox also gets
an egress credential: handed to its agent (never written to the data dir), its
digest published with the sandbox for the lease to bind; the agent relays a port
on the sandbox's own loopback to that socket (docs/egress.md).

When sandpool runs as root, sandboxed code runs as an unprivileged uid: by
default one of its own per sandbox (so sandboxes cannot signal each other's
processes or open each other's files, and destroy can kill every process of
that uid, including ones that escaped the process tree). Limits are rlimits
applied by the agent to everything it starts. What the host cannot give is
named in `describe()["warnings"]` and logged loudly at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import secrets
import shutil
import stat
import sys
import time
from pathlib import Path

from sandpool.controller.provider import SANDBOX_ID_LENGTH, LostListener, PoolSpec, ProviderError, SandboxInfo
from sandpool.core.fds import until_ready
from sandpool.core.settings import ConfigurationError
from sandpool.providers.local import environments, fsmount
from sandpool.providers.local.isolation.detect import required_missing
from sandpool.providers.local.launcher import AgentSecret, EgressAccess, Launcher, SandboxLimits
from sandpool.providers.local.procs import ProcessHandle, is_alive, kill_uid
from sandpool.providers.local.settings import MIB, NOBODY, LocalProviderSettings, cpu_millis, default_sandbox_python
from sandpool.providers.local.sockets import SOCKET_PATH_MAX, SocketDir
from sandpool.providers.local.zygote import ZygoteError, ZygoteLauncher, make_launcher, shutdown_listening
from sandpool.state.keys import egress_digest

ZYGOTE_SOCKET = "zygote.sock"
"""Where a zygote that outlives its controller waits, in the data dir's socket directory."""

log = logging.getLogger("sandpool.providers.local")

SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")


_AS_MADE = ("meta.json", "secret", "agent.pid", "agent.log")
"""The files a sandbox directory holds beside its workspace (the module docstring's layout)."""


def _remove(sandbox_dir: Path) -> None:
    """Remove a sandbox directory, in a worker thread: an rmdir can block for milliseconds (1-2 ms at
    the median under churn on ext4, up to ~15 ms: measured), which the event loop must not. What the
    provider made (four files, an empty workspace once its tmpfs is gone) is unlinked by name;
    rmtree's walk only when anything else is there."""
    try:
        for name in _AS_MADE:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sandbox_dir / name)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(sandbox_dir / "workspace")
        os.rmdir(sandbox_dir)
    except FileNotFoundError:
        raise
    except OSError:
        shutil.rmtree(sandbox_dir, ignore_errors=False)


def data_dir_need(path: Path) -> str:
    """What the data dir needs, said for this process's uid (the controller chmods it, so it must own it)."""
    uid = os.geteuid()
    try:
        owner = path.stat().st_uid
    except OSError:
        return f"uid {uid} must be able to create it: its parent must exist and be writable by uid {uid}"
    if owner != uid:
        return (f"uid {uid} must own it, and uid {owner} does: chown {uid} it, or name a directory "
                f"inside it that uid {uid} can create")
    return f"uid {uid} owns it but cannot set its mode or write in it"


class LocalProvider:
    name = "local"

    def __init__(self, settings: LocalProviderSettings | None = None, *, launcher: Launcher | None = None) -> None:
        self.settings = settings or LocalProviderSettings()
        self.launcher: Launcher = launcher or make_launcher(self.settings)
        options = getattr(self.launcher, "agent_options", None)  # the zygote's agents take settings directly
        if isinstance(options, dict):
            options.setdefault("spare_interpreter", self.settings.spare_interpreter)
            options.setdefault("log_level", self.settings.agent_log_level)
        self.root = self.settings.sandboxes_dir()
        self.sockets = SocketDir(self.root.parent)
        self.privileged = self.settings.privileged()
        self.tmpfs_ok = self.privileged and self.settings.workspace_tmpfs
        self.host_tmpfs = self.tmpfs_ok  # False when the launcher mounts the capped tmpfs itself
        self.sandbox_python = self.settings.sandbox_python
        if self.sandbox_python is None and self.privileged:
            self.sandbox_python = default_sandbox_python(self.settings.agent_python or sys.executable)
        self.environments: dict[str, environments.Environment] = {}
        self.warnings: list[str] = []
        self._lost_listener: LostListener | None = None
        self._creating: set[str] = set()  # a sandbox that dies while created fails its create instead
        self._uids: dict[tuple[str, int], int] = {}  # uid of each sandbox directory (name, inode) read so far
        self._made: dict[str, tuple[dict[str, object], ProcessHandle]] = {}
        """meta.json and agent.pid of the sandboxes this provider started, as written: destroy reads
        the files only for a sandbox an earlier provider started."""

    # --- lifecycle of the provider itself ------------------------------------------------
    async def start(self) -> None:
        self._check_egress_socket()
        self.environments = await asyncio.to_thread(self._resolve_environments)
        roots = self._environment_roots()  # refused before anything is made
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            os.chmod(self.root.parent, 0o711)
            os.chmod(self.root, 0o711)
        except OSError as exc:
            raise ProviderError(f"cannot use --data-dir {self.root.parent}: {exc.strerror} "
                                f"({data_dir_need(self.root.parent)})", transient=False) from None
        try:
            self.sockets.open(SANDBOX_ID_LENGTH)
        except OSError as exc:
            raise ProviderError(f"cannot make a directory for agent sockets: {exc}", transient=False) from None
        if hasattr(self.launcher, "extra_paths"):  # the zygote binds them into every sandbox root
            self.launcher.extra_paths = roots
        if self.settings.sandboxes_outlive_controller and isinstance(self.launcher, ZygoteLauncher):
            assert self.sockets.root is not None
            self.launcher.listen_path = self.sockets.root / ZYGOTE_SOCKET
            self.launcher.end_with_pid = self.settings.sandboxes_end_with_pid
        starter = getattr(self.launcher, "start", None)  # the zygote: detects and logs its isolation
        if starter is not None:
            try:
                await starter()
            except ZygoteError as exc:
                raise ProviderError(str(exc), transient=False) from None
        # A launcher that mounts the capped workspace in the sandbox's own mount namespace (the
        # zygote) spares the host a mount and an unmount per sandbox, both on this event loop.
        self.host_tmpfs = self.tmpfs_ok and not self.launcher.describe().get("caps_workspace")
        if self.privileged and not self.launcher.describe().get("namespaces"):
            blocked = [p for p in self.root.parents if not os.stat(p).st_mode & 0o001]
            if blocked:
                raise ProviderError(f"{blocked[0]} is not searchable by other users, so sandboxed code "
                                    "(an unprivileged uid) could not reach its workspace: choose a --data-dir "
                                    "under world-searchable directories", transient=False)
        self.warnings = self._missing_isolation()
        if self.settings.isolation_required:
            self._require_isolation()
        for warning in self.warnings:
            log.warning("local sandboxes are weakly isolated: %s", warning)

    def _check_egress_socket(self) -> None:
        """Refuse an egress socket no agent could connect to (an agent without a private root uses the
        host path itself, so it must fit in sun_path); warn when nothing listens there yet."""
        path = self.settings.egress_socket
        if path is None:
            return
        if not path.is_absolute() or len(os.fsencode(path)) > SOCKET_PATH_MAX:
            raise ProviderError(f"--egress-socket {path} must be an absolute path of at most {SOCKET_PATH_MAX} "
                                "bytes", transient=False)
        try:
            is_socket = stat.S_ISSOCK(os.stat(path).st_mode)
        except OSError:
            is_socket = False
        if not is_socket:
            log.warning("no egress proxy listens at --egress-socket %s yet: sandboxed code's connections "
                        "through it fail until one does", path)

    def _resolve_environments(self) -> dict[str, environments.Environment]:
        """The environments sandboxes run, by name: `python` and those the pools file declares.

        Only what is built is used (`sandpool up` builds them first): a declared environment that
        is not built stops the start, and an unbuilt `python` falls back to the host's Python
        with a warning, as before environments existed.
        """
        s = self.settings
        try:
            declared = environments.declared(s.pools_file) if s.pools_file is not None else {}
        except ConfigurationError as exc:
            raise ProviderError(str(exc), transient=False) from None
        lock = s.sandbox_requirements or environments.default_lock()
        python_spec = declared.get(environments.BUILTIN) or (
            environments.EnvironmentSpec(environments.BUILTIN, Path(lock).absolute()) if lock else None)
        preimport = python_spec.preimport if python_spec else ()
        cache = s.environments_cache()
        found: dict[str, environments.Environment] = {}
        try:
            if s.sandbox_python is not None:
                found[environments.BUILTIN] = environments.from_interpreter(s.sandbox_python, preimport=preimport)
            elif python_spec is not None:
                with contextlib.suppress(environments.EnvironmentUnavailable):  # the fallback below, warned
                    built = environments.find(python_spec, cache, environments.base_python(self.privileged))
                    if built is not None:
                        found[environments.BUILTIN] = built
            others = {name: spec for name, spec in declared.items() if name != environments.BUILTIN}
            base = environments.base_python(self.privileged) if others else None
            for name, spec in others.items():
                assert base is not None
                built = environments.find(spec, cache, base)
                if built is None:
                    raise ProviderError(f"sandbox environment {name} is not built in {cache} (`sandpool up` "
                                        "builds it, or python -m sandpool.providers.local.environments "
                                        f"--pools-file {s.pools_file})", transient=False)
                found[name] = built
        except environments.EnvironmentUnavailable as exc:
            raise ProviderError(str(exc), transient=False) from None
        if environments.BUILTIN in found:
            self.sandbox_python = found[environments.BUILTIN].python
        else:
            log.warning("the sandbox environment python is not built: sandboxed code runs on %s, which may lack "
                        "numpy, pandas, scipy, sympy and matplotlib (`sandpool up` builds the environment; "
                        "see docs/sandboxes.md)", self.sandbox_python or "the agent's own Python")
        return found

    def _environment_roots(self) -> tuple[str, ...]:
        """Host directories every sandbox sees read-only so the environments' interpreters run;
        never one holding the data dir (sandboxes, secrets) or the filesystem root."""
        roots: list[str] = []
        data_dir = os.path.realpath(self.root.parent)
        for environment in self.environments.values():
            for root in environment.roots:
                real = os.path.realpath(root)
                if real == "/" or data_dir == real or data_dir.startswith(real.rstrip("/") + "/"):
                    raise ProviderError(f"sandbox environment {environment.name}: {real} holds the data dir "
                                        f"{data_dir}, which sandboxes must not see: choose another "
                                        "--data-dir or interpreter", transient=False)
                roots.append(real)
        return tuple(dict.fromkeys(roots))

    def environment_for(self, pool: PoolSpec | None) -> environments.Environment | None:
        """The environment a pool's sandboxes run: the one its `image` names, else `python`."""
        if pool is not None and pool.image in self.environments:
            return self.environments[pool.image]
        return self.environments.get(environments.BUILTIN)

    async def close(self) -> None:
        closer = getattr(self.launcher, "aclose", None)
        if closer is not None:
            await closer()
        self.sockets.close_if_empty()

    def _require_isolation(self) -> None:
        """--isolation-required: refuse to serve with less than every layer not turned off."""
        report = getattr(self.launcher, "report", None)
        if report is None:
            raise ProviderError("isolation is required but sandboxes would be plain subprocesses "
                                f"({self.launcher.describe().get('launcher')} launcher)", transient=False)
        missing = required_missing(report, frozenset(self.settings.isolation_disable))
        if missing:
            raise ProviderError("isolation is required but this host lacks " + "; ".join(missing),
                                transient=False)

    def _missing_isolation(self) -> list[str]:
        missing = []
        described = self.launcher.describe()
        if not self.privileged:
            missing.append("not running as root: sandboxed code runs as the service's own user and "
                           "could signal its processes and read its files")
        elif not self.settings.sandbox_uid_range:
            missing.append("one uid shared by all sandboxes: sandboxes can signal each other's processes")
        if not described.get("namespaces"):
            missing.append("no namespaces: sandboxes share the host's network, mounts and process table")
        if not self.tmpfs_ok:
            missing.append("no workspace size cap (needs root): a sandbox can fill the disk up to its "
                           "per-file size limit many times over")
        return missing

    def describe(self) -> dict[str, object]:
        s = self.settings
        return {
            "provider": self.name,
            **self.launcher.describe(),
            "sandboxes_dir": str(self.root),
            "sandbox_python": self.sandbox_python,
            "environments": {name: env.python for name, env in self.environments.items()},
            "uids": ("per-sandbox " + s.sandbox_uid_range if self.privileged and s.sandbox_uid_range
                     else str(s.sandbox_uid or NOBODY) if self.privileged else "service user"),
            "workspace_cap_mb": s.workspace_size_mb if self.tmpfs_ok else None,
            "rlimits": {"memory_mb": s.memory_mb, "max_processes": s.max_processes,
                        "max_open_files": s.max_open_files, "max_file_size_mb": s.max_file_size_mb},
            "cpu_limit": s.cpu_limit or None,
            "egress_socket": str(s.egress_socket) if s.egress_socket is not None else None,
            "warnings": list(self.warnings),
        }

    # --- the provider protocol -----------------------------------------------------------
    def on_lost(self, listener: LostListener) -> None:
        """Tell `listener` at once when a sandbox's agent exits on its own (the zygote reports it;
        the plain subprocess launcher cannot, and reconciliation finds those later)."""
        self._lost_listener = listener
        if hasattr(self.launcher, "on_exit"):
            self.launcher.on_exit = self._sandbox_exited

    def _sandbox_exited(self, sandbox_id: str) -> None:
        listener = self._lost_listener
        if listener is None or sandbox_id in self._creating:
            return
        try:
            listener(sandbox_id, "failed")
        except Exception:
            log.exception("sandbox loss listener failed", extra={"sandbox_id": sandbox_id})

    async def create(self, pool: PoolSpec, sandbox_id: str) -> SandboxInfo:
        sandbox_dir = self._dir(sandbox_id)
        try:
            sandbox_dir.mkdir(mode=0o711)
        except FileExistsError:
            raise ProviderError(f"sandbox {sandbox_id} already exists", transient=False) from None
        except OSError as exc:
            raise ProviderError(f"cannot create sandbox directory: {exc.strerror}") from None
        self._creating.add(sandbox_id)
        try:
            return await self._create_in(pool, sandbox_id, sandbox_dir)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await self.destroy(sandbox_id)
            if isinstance(exc, ProviderError) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, OSError):
                raise ProviderError(f"sandbox {sandbox_id} failed to start: {exc.strerror or exc}") from None
            raise ProviderError(f"sandbox {sandbox_id} failed to start: {type(exc).__name__}") from exc
        finally:
            self._creating.discard(sandbox_id)

    async def _create_in(self, pool: PoolSpec, sandbox_id: str, sandbox_dir: Path) -> SandboxInfo:
        os.chmod(sandbox_dir, 0o711)
        limits = self._limits(sandbox_id, pool)
        try:
            socket_path = self.sockets.path_for(sandbox_id)
        except OSError as exc:
            raise ProviderError(f"cannot make the socket directory of sandbox {sandbox_id}: {exc}",
                                transient=False) from None
        meta: dict[str, object] = {
            "pool": pool.name, "uid": limits.uid, "gid": limits.gid, "created_at": time.time(),
            "dedicated_uid": self._dedicated(limits.uid), "socket": str(socket_path)}
        (sandbox_dir / "meta.json").write_text(json.dumps(meta))
        egress = None
        if self.settings.egress_socket is not None:
            egress = EgressAccess(socket=str(self.settings.egress_socket), credential=secrets.token_urlsafe(32))
            limits = dataclasses.replace(limits, egress=egress)
        secret = AgentSecret(value=secrets.token_urlsafe(32), file=sandbox_dir / "secret")
        fd = os.open(secret.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.value)
        workspace = sandbox_dir / "workspace"
        workspace.mkdir(mode=0o700)
        self._prepare_workspace(workspace, limits)
        ready_r, ready_w = os.pipe()
        try:
            try:
                handle = await self.launcher.launch(sandbox_id, workspace, socket_path, secret, limits,
                                                    log_path=sandbox_dir / "agent.log", ready_fd=ready_w)
            finally:
                os.close(ready_w)  # the agent holds the only write end now: end-of-file if it dies
            self._made[sandbox_id] = (meta, handle)  # before the file: a failed write's destroy still kills it
            (sandbox_dir / "agent.pid").write_text(handle.to_line())
            await self._wait_serving(sandbox_id, socket_path, ready_r)
        finally:
            os.close(ready_r)
        return SandboxInfo(sandbox_id=sandbox_id, pool=pool.name, address=f"unix://{socket_path}",
                           secret=secret.value, ready=True,
                           egress_digest=egress_digest(egress.credential) if egress is not None else None)

    async def destroy(self, sandbox_id: str) -> None:
        if not SANDBOX_ID.match(sandbox_id):
            return  # nothing of ours can have that name
        sandbox_dir = self._dir(sandbox_id)
        made = self._made.get(sandbox_id)
        # A sandbox of ours whose directory is gone was destroyed by another provider on this data dir: its
        # pid, and above all its uid, may be another sandbox's by now, so nothing is killed by what we remember.
        if made is None or os.path.lexists(sandbox_dir):
            try:
                meta, handle = made if made is not None else (self._meta(sandbox_dir), self._handle(sandbox_dir))
                contained = await self.launcher.kill(handle) if handle is not None else False
                uid, gid = meta.get("uid"), meta.get("gid")
                if not contained and meta.get("dedicated_uid") and isinstance(uid, int) and self._dedicated(uid):
                    if not await kill_uid(uid, gid if isinstance(gid, int) else uid):
                        raise ProviderError(f"processes of sandbox {sandbox_id} survived SIGKILL")
                socket_path = self._socket(sandbox_dir, meta)
                if socket_path is not None:
                    SocketDir.remove(socket_path)
                fsmount.unmount_under(sandbox_dir)
                await asyncio.to_thread(_remove, sandbox_dir)
            except FileNotFoundError:
                pass  # gone meanwhile
            except OSError as exc:
                raise ProviderError(f"cannot destroy sandbox {sandbox_id}: {exc.strerror or exc}") from None
        self._made.pop(sandbox_id, None)  # gone (a failed destroy keeps what we remember, for its retry)

    async def list(self) -> list[SandboxInfo]:
        try:
            entries = sorted(p for p in self.root.iterdir() if p.is_dir() and SANDBOX_ID.match(p.name))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ProviderError(f"cannot list sandboxes: {exc.strerror}") from None
        found = []
        for sandbox_dir in entries:
            meta = self._meta(sandbox_dir)
            handle = self._handle(sandbox_dir)
            try:
                secret = (sandbox_dir / "secret").read_text().strip() or None
            except OSError:
                secret = None
            socket_path = self._socket(sandbox_dir, meta)
            found.append(SandboxInfo(
                sandbox_id=sandbox_dir.name, pool=str(meta.get("pool") or ""),
                address=f"unix://{socket_path}" if socket_path else None, secret=secret,
                ready=handle is not None and is_alive(handle)))
        # What another provider on this data dir destroyed (a controller that took over) is forgotten here.
        listed = {entry.name for entry in entries} | self._creating
        self._made = {sandbox_id: made for sandbox_id, made in self._made.items() if sandbox_id in listed}
        return found

    async def destroy_all(self) -> int:
        """Destroy every sandbox under the data dir, and a zygote left to outlive its controller
        (`sandpool up` on its way out)."""
        sandboxes = await self.list()
        await asyncio.gather(*(self.destroy(s.sandbox_id) for s in sandboxes))
        root = self.sockets.current()
        if isinstance(self.launcher, ZygoteLauncher) and self.launcher.listen_path and self.launcher.client.alive:
            await self.launcher.client.shutdown()  # ours: a zygote serves one controller at a time
        elif root is not None and (root / ZYGOTE_SOCKET).exists():
            await shutdown_listening(root / ZYGOTE_SOCKET)  # one a stopped controller left running
        if root is not None:
            shutil.rmtree(root / "zygote-run", ignore_errors=True)
        self.sockets.close_if_empty()
        return len(sandboxes)

    # --- helpers -------------------------------------------------------------------------
    def _dir(self, sandbox_id: str) -> Path:
        if not SANDBOX_ID.match(sandbox_id):
            raise ProviderError(f"invalid sandbox id {sandbox_id!r}", transient=False)
        return self.root / sandbox_id

    @staticmethod
    def _meta(sandbox_dir: Path) -> dict[str, object]:
        try:
            data = json.loads((sandbox_dir / "meta.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _socket(sandbox_dir: Path, meta: dict[str, object]) -> Path | None:
        """The agent's socket as recorded at create (never derived from a path the sandbox controls)."""
        recorded = meta.get("socket")
        return Path(recorded) if isinstance(recorded, str) and recorded.startswith("/") else None

    @staticmethod
    def _handle(sandbox_dir: Path) -> ProcessHandle | None:
        try:
            return ProcessHandle.from_line((sandbox_dir / "agent.pid").read_text())
        except OSError:
            return None

    def _dedicated(self, uid: int | None) -> bool:
        """The uid belongs to one sandbox only, so every process of it may be killed."""
        if uid is None or not self.privileged or not self.settings.sandbox_uid_range:
            return False
        low, high = self.settings.uid_range()
        return low <= uid <= high and uid != os.getuid()

    def _limits(self, sandbox_id: str, pool: PoolSpec | None = None) -> SandboxLimits:
        s = self.settings
        uid: int | None = None
        gid: int | None = None
        if self.privileged:
            if s.sandbox_uid_range:
                uid = self._free_uid()
                gid = uid
            else:
                uid = s.sandbox_uid or NOBODY
                gid = s.sandbox_gid or uid
        environment = self.environment_for(pool)
        return SandboxLimits(uid=uid, gid=gid, memory_bytes=s.memory_mb * MIB, max_processes=s.max_processes,
                             max_open_files=s.max_open_files, max_file_size_bytes=s.max_file_size_mb * MIB,
                             workspace_bytes=s.workspace_size_mb * MIB if self.tmpfs_ok else None,
                             sandbox_python=environment.python if environment else self.sandbox_python,
                             matplotlib_cache=environment.matplotlib_cache if environment else None,
                             preimport=environment.preimport if environment else (),
                             spare_interpreter=s.spare_interpreter,
                             agent_log_level=s.agent_log_level, cpu_millis=cpu_millis(pool, s.cpu_limit))

    def _free_uid(self) -> int:
        """A uid of the range no sandbox on disk holds (chosen and recorded with no await between)."""
        low, high = self.settings.uid_range()
        taken = self._taken_uids()
        if len(taken) > high - low:
            raise ProviderError("no free sandbox uid left in --sandbox-uid-range")
        while True:
            uid = random.randint(low, high)
            if uid not in taken:
                return uid

    def _taken_uids(self) -> set[int]:
        """The uids of the sandboxes on disk, whoever made them (another replica, an earlier run).

        A sandbox's uid never changes once its meta.json is written, so each is read once and
        remembered by the directory's name and inode: a create lists the directory instead of
        reading every sandbox's file (0.5 ms of the controller's CPU per create with ~25 on disk).
        A sandbox whose meta.json is not written yet is read again next time."""
        seen: dict[tuple[str, int], int] = {}
        with os.scandir(self.root) as entries:
            for entry in entries:
                key = (entry.name, entry.inode())
                uid = self._uids.get(key)
                if uid is None:
                    found = self._meta(Path(entry.path)).get("uid")
                    if not isinstance(found, int):
                        continue
                    uid = found
                seen[key] = uid
        self._uids = seen
        return set(seen.values())

    def _prepare_workspace(self, workspace: Path, limits: SandboxLimits) -> None:
        if self.host_tmpfs and limits.workspace_bytes:
            try:
                fsmount.mount_tmpfs(workspace, size=limits.workspace_bytes, uid=limits.uid or 0,
                                    gid=limits.gid or 0)
                return
            except OSError as exc:
                self.tmpfs_ok = self.host_tmpfs = False
                warning = f"cannot mount a size-capped workspace ({exc.strerror}): no workspace size cap"
                self.warnings.append(warning)
                log.warning("local sandboxes are weakly isolated: %s", warning)
        if limits.uid is not None:
            os.chown(workspace, limits.uid, limits.gid if limits.gid is not None else limits.uid)
        os.chmod(workspace, 0o700)

    async def _wait_serving(self, sandbox_id: str, socket_path: Path, ready_r: int) -> None:
        """Until the agent says `ok` on its readiness pipe, which it does once it accepts
        connections with its interpreter warm (what `/healthz` would answer): no polling and no
        request, which cost the controller ~0.45 ms of CPU per sandbox. End-of-file: it died first."""
        try:
            async with asyncio.timeout(self.settings.start_timeout_seconds):
                await until_ready(ready_r)
        except TimeoutError:
            raise ProviderError(f"agent of sandbox {sandbox_id} did not report serving "
                                f"within {self.settings.start_timeout_seconds:g}s") from None
        if os.read(ready_r, 16) != b"ok":
            raise ProviderError(f"agent of sandbox {sandbox_id} exited while starting: "
                                f"{self._log_tail(self._dir(sandbox_id))}")
        if not socket_path.exists():  # serving, but not where the api will call it
            raise ProviderError(f"agent of sandbox {sandbox_id} serves, but its socket is not at the host path")

    @staticmethod
    def _log_tail(sandbox_dir: Path) -> str:
        try:
            lines = (sandbox_dir / "agent.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:])[-500:] or "(empty log)"
