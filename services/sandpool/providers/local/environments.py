"""Sandbox environments: the Python local sandboxes run code with, built once from a requirements lock.

Sandboxed code never runs on whatever the host happens to have. The `python`
environment (the default) is a venv made from `deploy/requirements/sandbox.txt`,
the sandbox image's own lock, so local and Kubernetes sandboxes import the same
packages at the same versions; the pools file may declare more (`environments:`),
and a pool's `image` names the one its sandboxes run (what the CreateSession `image`
hint means for the local provider).

A built environment is a directory of the cache (`--environments-dir`) named by a
digest of its lock and its base Python, so it is built once and shared read-only by
every sandbox: the zygote binds it into each sandbox root, nothing is copied per
sandbox. A build runs `pip install --require-hashes --no-deps -r LOCK` into a temporary
directory that is renamed into place only when complete, under a lock file: a crash
never leaves a half environment that a later run would use, and two builders never
race. It also pre-builds matplotlib's font cache (as the sandbox image does) and
replaces pip with `offline_pip.py`, which refuses `pip install` at once, saying why.
An environment declared with `pip: true` also gets a copy of the builder's real pip
(`share/sandpool/pip`) and a site hook (`_sandpool_pip_layer`): in a sandbox with
egress, `pip install` then installs into the session's own layer under its
workspace, which the hook puts on sys.path after the environment's own packages.

    python -m sandpool.providers.local.environments [--pools-file F]   # build; print the interpreter
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import sandpool

BUILTIN = "python"
"""The default environment: every pool whose `image` names no other one runs it."""
MARKER = "sandpool-environment.json"
"""Written last into a finished build: a directory without it is no environment."""
MATPLOTLIB_CACHE = "share/sandpool/matplotlib"
BUILD_TIMEOUT_SECONDS = 1800.0
PROBE_TIMEOUT_SECONDS = 30.0
_PROBE = ("import json, sys; print(json.dumps({'version': '%d.%d.%d' % sys.version_info[:3], "
          "'prefix': sys.prefix, 'base_prefix': sys.base_prefix, 'executable': sys.executable}))")

Progress = Callable[[str], None]


class EnvironmentUnavailable(Exception):
    """An environment cannot be built or found; the message is one line saying why and what to do."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """An environment as declared: its name, its lock (with hashes), modules to import before the first call."""

    name: str
    requirements: Path
    preimport: tuple[str, ...] = ()
    pip: bool = False
    """`pip install` into a per-session layer (with egress); a separate build of the same lock."""


@dataclass(frozen=True)
class PythonInfo:
    """What an interpreter says about itself."""

    executable: str
    version: str
    prefix: str
    base_prefix: str

    @property
    def minor(self) -> str:
        return ".".join(self.version.split(".")[:2])


@dataclass(frozen=True)
class Environment:
    """An environment sandboxes can run: its interpreter and the host directories it needs."""

    name: str
    python: str
    roots: tuple[str, ...]
    """Host directories a sandbox must see (read-only) for `python` to run: the environment and its base."""
    matplotlib_cache: str | None = None
    preimport: tuple[str, ...] = ()
    path: str | None = None
    """The built environment's directory; None for an interpreter given as is (`--sandbox-python`)."""
    details: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def pip(self) -> bool:
        """Built with a real pip for per-session installs (`pip: true`)."""
        return self.details.get("pip") is True


# --- where things are --------------------------------------------------------------------------


def default_lock() -> Path | None:
    """The sandbox image's lock in this checkout (`deploy/requirements/sandbox.txt`), if there is one."""
    lock = Path(sandpool.__file__).resolve().parents[2] / "deploy" / "requirements" / "sandbox.txt"
    return lock if lock.is_file() else None


def default_cache_dir(privileged: bool) -> Path:
    """Root: a system cache every sandbox uid can traverse (never root's home); else the user's cache."""
    if privileged:
        return Path("/var/cache/sandpool/environments")
    return Path.home() / ".cache" / "sandpool" / "environments"


def runnable_by_others(path: str | Path) -> bool:
    """Another uid may execute `path`: every parent searchable and the file executable by 'other'."""
    try:
        real = Path(path).resolve(strict=True)
        if not real.stat().st_mode & 0o001:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in real.parents)
    except OSError:
        return False


def probe(python: str) -> PythonInfo:
    """Ask `python` for its version and prefixes (one short run)."""
    try:
        done = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_SECONDS, check=False, env=_plain_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvironmentUnavailable(f"{python} does not run: {getattr(exc, 'strerror', None) or exc}") from None
    if done.returncode != 0:
        raise EnvironmentUnavailable(f"{python} does not run: {_last_line(done.stderr) or done.returncode}")
    try:
        data = json.loads(done.stdout)
        return PythonInfo(executable=python, version=data["version"], prefix=data["prefix"],
                          base_prefix=data["base_prefix"])
    except (ValueError, KeyError, TypeError):
        raise EnvironmentUnavailable(f"{python} is not a Python interpreter sandpool understands") from None


@functools.cache
def base_python(privileged: bool) -> PythonInfo:
    """The interpreter environments are made from: sandpool's own base Python, else the system's.

    As root it must be one a sandbox uid can run (a pyenv or venv under root's 0700 home
    is not), because the environment's `bin/python` is a link to it.
    """
    own = getattr(sys, "_base_executable", None) or sys.executable
    for candidate in dict.fromkeys((own, "/usr/bin/python3", "/usr/local/bin/python3")):
        if not os.path.isfile(candidate) or (privileged and not runnable_by_others(candidate)):
            continue
        try:
            return probe(candidate)
        except EnvironmentUnavailable:
            continue
    raise EnvironmentUnavailable("no Python to make sandbox environments from" +
                                 (" that other users may run (sandpool's own is not)" if privileged else "") +
                                 ": install python3, or pass --sandbox-python")


def environment_key(lock: bytes, base: PythonInfo, *, pip: bool = False) -> str:
    """The cache directory name of (this lock, this base Python, pip or not): same inputs, same environment."""
    # The salt names the build recipe: bump it when a build would make something different.
    digest = hashlib.sha256(b"sandpool-environment-1\0" + lock + b"\0" +
                            os.path.realpath(base.executable).encode() + b"\0" + base.version.encode() +
                            (b"\0pip" if pip else b""))
    return f"py{base.minor}-{digest.hexdigest()[:16]}"


def _read_lock(spec: EnvironmentSpec) -> bytes:
    try:
        return Path(spec.requirements).read_bytes()
    except OSError as exc:
        raise EnvironmentUnavailable(f"environment {spec.name}: cannot read its requirements lock "
                                     f"{spec.requirements}: {exc.strerror}") from None


def location(spec: EnvironmentSpec, cache_dir: Path, base: PythonInfo) -> Path:
    return Path(cache_dir).absolute() / environment_key(_read_lock(spec), base, pip=spec.pip)


def declared(pools_file: Path) -> dict[str, EnvironmentSpec]:
    """The environments a pools file declares (`environments:`), by name."""
    from sandpool.controller.templates import load_environments

    return {t.name: EnvironmentSpec(t.name, t.requirements, tuple(t.preimport), pip=t.pip)
            for t in load_environments(pools_file)}


# --- using what is built ---------------------------------------------------------------------


def find(spec: EnvironmentSpec, cache_dir: Path, base: PythonInfo) -> Environment | None:
    """The built environment of `spec`, or None when it has not been built (for this base Python)."""
    return load(location(spec, cache_dir, base), name=spec.name, preimport=spec.preimport)


def load(path: Path, *, name: str, preimport: tuple[str, ...] = ()) -> Environment | None:
    """A finished environment directory (its marker written), or None."""
    try:
        details = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    python = path / "bin" / "python"
    if not isinstance(details, dict) or not os.access(python, os.X_OK):
        return None
    cache = details.get("matplotlib_cache")
    base_prefix = details.get("base_prefix")
    roots = (str(path), *([base_prefix] if isinstance(base_prefix, str) else []))
    return Environment(name=name, python=str(python), roots=roots, preimport=tuple(preimport),
                       matplotlib_cache=str(path / cache) if isinstance(cache, str) else None,
                       path=str(path), details=details)


def from_interpreter(python: str, *, name: str = BUILTIN, preimport: tuple[str, ...] = ()) -> Environment:
    """An interpreter given as is (`--sandbox-python`); a built environment's own is recognised by its marker."""
    info = probe(python)
    built = load(Path(info.prefix), name=name, preimport=preimport)
    if built is not None:
        return built
    return Environment(name=name, python=python, roots=tuple(dict.fromkeys((info.prefix, info.base_prefix))),
                       preimport=tuple(preimport))


# --- building ----------------------------------------------------------------------------------


def ensure(spec: EnvironmentSpec, cache_dir: Path, base: PythonInfo, *,
           progress: Progress | None = None) -> Environment:
    """The environment of `spec`, built first if it is not in the cache yet."""
    found = find(spec, cache_dir, base)
    return found if found is not None else build(spec, cache_dir, base, progress=progress)


def build(spec: EnvironmentSpec, cache_dir: Path, base: PythonInfo, *, progress: Progress | None = None,
          pip_python: str | None = None) -> Environment:
    """Build `spec` into the cache (or find it built by a concurrent builder); see the module's docstring."""
    say = progress or (lambda _line: None)
    cache_dir = Path(cache_dir).absolute()
    lock_bytes = _read_lock(spec)
    final = cache_dir / environment_key(lock_bytes, base, pip=spec.pip)
    try:
        _make_dirs(cache_dir)
        lock_fd = os.open(cache_dir / f".{final.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise EnvironmentUnavailable(f"cannot use the environments cache {cache_dir}: {exc.strerror} "
                                     "(choose another with --environments-dir)") from None
    try:
        if _try_lock(lock_fd) is False:
            say(f"environment {spec.name}: another process is building it; waiting")
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = load(final, name=spec.name, preimport=spec.preimport)
        if done is not None:
            return done
        for stale in cache_dir.glob(f".{final.name}.build-*"):  # a crashed build's; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # no marker: not an environment (hand-made, or from before markers)
            shutil.rmtree(final, ignore_errors=True)
        return _build_locked(spec, lock_bytes, final, base, say, pip_python or sys.executable)
    finally:
        os.close(lock_fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _make_dirs(path: Path) -> None:
    """Create `path` and its missing parents 0755: sandbox uids traverse them without namespaces."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o755)
        os.chmod(directory, 0o755)


def _build_locked(spec: EnvironmentSpec, lock_bytes: bytes, final: Path, base: PythonInfo, say: Progress,
                  pip_python: str) -> Environment:
    started = time.monotonic()
    tmp = final.with_name(f".{final.name}.build-{os.getpid()}")
    log_path = final.with_name(f".{final.name}.log")
    packages = _count_requirements(lock_bytes)
    say(f"environment {spec.name}: building from {spec.requirements} ({_plural(packages, 'package')}, "
        f"Python {base.version}) into {final}; once per lock")
    try:
        with open(log_path, "w", encoding="utf-8") as log_file:
            _run([base.executable, "-m", "venv", "--without-pip", "--prompt", "sandpool", str(tmp)], log_file, spec,
                 what="make a venv")
            python = tmp / "bin" / "python"
            _pip_install(spec, python, pip_python, log_file, say, packages)
            cache = tmp / MATPLOTLIB_CACHE
            cache.mkdir(parents=True, mode=0o755)
            if list((tmp / "lib").glob("python3*/site-packages/matplotlib")):
                say(f"environment {spec.name}: pre-building the matplotlib font cache")
                _run([str(python), "-I", "-c", "import matplotlib.font_manager"], log_file, spec,
                     what="build the matplotlib font cache", env={"MPLCONFIGDIR": str(cache), "MPLBACKEND": "Agg"})
            _install_offline_pip(python)
            if spec.pip:
                say(f"environment {spec.name}: adding pip for per-session installs")
                _install_real_pip(tmp, pip_python, spec)
        _relocate(tmp, final)
        details = {
            "lock": str(spec.requirements), "lock_sha256": hashlib.sha256(lock_bytes).hexdigest(),
            "packages": packages, "python": base.version, "base_python": base.executable,
            "base_prefix": base.base_prefix, "matplotlib_cache": MATPLOTLIB_CACHE,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - started, 1),
            "pip": spec.pip,
        }
        (tmp / MARKER).write_text(json.dumps(details, indent=2) + "\n")
        _open_up(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"environment {spec.name}: built in {details['build_seconds']:g}s")
    built = load(final, name=spec.name, preimport=spec.preimport)
    assert built is not None
    return built


def _plural(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 's'}"


def _count_requirements(lock: bytes) -> int:
    return sum(1 for line in lock.decode(errors="replace").splitlines()
               if line.strip() and not line[0].isspace() and not line.startswith(("#", "-")))


def _plain_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The build's environment: this process's (pip's own configuration, a proxy) minus Python's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "SANDPOOL_"))}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1", **(extra or {}))
    return env


def _umask() -> None:
    os.umask(0o022)  # sandbox uids read what the build writes


def _run(argv: list[str], log_file, spec: EnvironmentSpec, *, what: str,
         env: dict[str, str] | None = None) -> None:
    log_file.write(f"$ {' '.join(argv)}\n")
    log_file.flush()
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                              env=_plain_env(env), timeout=BUILD_TIMEOUT_SECONDS, preexec_fn=_umask, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvironmentUnavailable(f"cannot build the sandbox environment {spec.name}: could not {what}: "
                                     f"{getattr(exc, 'strerror', None) or exc}") from None
    if done.returncode != 0:
        raise EnvironmentUnavailable(f"cannot build the sandbox environment {spec.name}: could not {what} "
                                     f"(status {done.returncode}; its output: {log_file.name})")


def _pip_install(spec: EnvironmentSpec, python: Path, pip_python: str, log_file, say: Progress,
                 packages: int) -> None:
    """`pip install --require-hashes --no-deps -r LOCK` into the new venv, with sandpool's own pip
    (`--python`: the venv gets no pip of its own), streaming a line of progress per package."""
    argv = [pip_python, "-m", "pip", "--python", str(python), "install", "--require-hashes", "--no-deps",
            "--no-input", "--progress-bar", "off", "--no-warn-script-location", "-r", str(spec.requirements)]
    log_file.write(f"$ {' '.join(argv)}\n")
    log_file.flush()
    errors: list[str] = []
    collected = 0
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=_plain_env(), preexec_fn=_umask, text=True, errors="replace")
    except OSError as exc:
        raise EnvironmentUnavailable(f"cannot build the sandbox environment {spec.name}: cannot run pip: "
                                     f"{exc.strerror}") from None
    watchdog = threading.Timer(BUILD_TIMEOUT_SECONDS, proc.kill)  # a pip that hangs is ended
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log_file.write(line)
            text = line.strip()
            if text.startswith(("Collecting ", "Processing ")):
                collected += 1
                what = text.split()[1]
                what = what if text.startswith("Collecting ") else "-".join(Path(what).name.split("-")[:2])
                say(f"environment {spec.name}: fetching {collected}/{packages} {what}")
            elif text.startswith("Installing collected packages"):
                say(f"environment {spec.name}: installing {_plural(packages, 'package')}")
            elif text.startswith("ERROR:"):
                errors.append(text)
        code = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0:
        if "No module named pip" in "".join(errors) or (not errors and collected == 0 and code == 1):
            reason = f"{pip_python} has no pip (python -m ensurepip), or pip failed before installing"
        else:
            reason = errors[0].removeprefix("ERROR: ") if errors else f"pip exited with status {code}"
        raise EnvironmentUnavailable(f"cannot build the sandbox environment {spec.name} from {spec.requirements}: "
                                     f"{reason} (pip's full output: {log_file.name})")


def _install_offline_pip(python: Path) -> None:
    """pip in the environment is `offline_pip.py`: `pip install` fails at once, saying why."""
    source = (Path(__file__).with_name("offline_pip.py")).read_text()
    found = list((python.parent.parent / "lib").glob("python3*/site-packages"))
    if len(found) != 1:
        raise EnvironmentUnavailable(f"the new venv at {python.parent.parent} has no single site-packages")
    package = found[0] / "pip"
    package.mkdir(mode=0o755)
    (package / "__init__.py").write_text(source)
    (package / "__main__.py").write_text("from pip import run\n\nrun()\n")
    subprocess.run([str(python), "-I", "-m", "compileall", "-q", str(package)], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_SECONDS,
                   env=_plain_env(), preexec_fn=_umask)
    minor = found[0].parent.name.removeprefix("python")
    script = f"#!{python}\nfrom pip import run\n\nrun()\n"
    for name in ("pip", "pip3", f"pip{minor}"):
        path = python.parent / name
        path.write_text(script)
        path.chmod(0o755)


REAL_PIP = "share/sandpool/pip"
"""Where a `pip: true` environment keeps the real pip (its `pip/__pip-runner__.py` runs exactly that copy)."""
LAYER_HOOK = '''"""A session's own packages: `pip install` in a sandbox with egress puts them under SANDBOX_PIP_LAYER
(the agent sets it: `.local` in the workspace); their site directory goes on sys.path after the
environment's own, which stays read-only and shared. Run at every interpreter start (a .pth line)."""
import os
import sys


def _add():
    prefix = os.environ.get("SANDBOX_PIP_LAYER")
    if not prefix or not os.path.isabs(prefix):
        return
    site = os.path.join(prefix, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")
    try:
        os.makedirs(site, exist_ok=True)  # there from the start, so later installs are found without a restart
    except OSError:
        return
    if site not in sys.path:
        sys.path.append(site)


_add()
'''


def _install_real_pip(venv: Path, pip_python: str, spec: EnvironmentSpec) -> None:
    """Copy the builder's pip (pure Python, everything vendored) into the environment, and the site hook."""
    try:
        done = subprocess.run([pip_python, "-c", "import os, pip; print(os.path.dirname(pip.__file__))"],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS, check=True,
                              env=_plain_env())
    except (OSError, subprocess.SubprocessError):
        raise EnvironmentUnavailable(f"cannot build the sandbox environment {spec.name}: {pip_python} has no pip "
                                     "to copy for `pip: true`") from None
    source = Path(done.stdout.strip())
    if not (source / "__pip-runner__.py").is_file():
        raise EnvironmentUnavailable(f"cannot build the sandbox environment {spec.name}: the pip at {source} is "
                                     "too old for `pip: true` (22.3 or later runs from a copy)")
    shutil.copytree(source, venv / REAL_PIP / "pip", ignore=shutil.ignore_patterns("__pycache__"))
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    (site_packages / "_sandpool_pip_layer.py").write_text(LAYER_HOOK)
    (site_packages / "_sandpool_pip_layer.pth").write_text("import _sandpool_pip_layer\n")
    subprocess.run([str(venv / "bin" / "python"), "-I", "-m", "compileall", "-q", str(venv / REAL_PIP)],
                   check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=BUILD_TIMEOUT_SECONDS,
                   env=_plain_env(), preexec_fn=_umask)


def _relocate(tmp: Path, final: Path) -> None:
    """Point what names the build directory (script shebangs, activate scripts, pyvenv.cfg, the
    font cache's font paths) at the final one. Text files only; never a binary."""
    old, new = str(tmp).encode(), str(final).encode()
    candidates = [p for p in (tmp / "bin").iterdir() if p.is_file() and not p.is_symlink()]
    candidates += [tmp / "pyvenv.cfg", *(tmp / MATPLOTLIB_CACHE).glob("*.json")]
    for path in candidates:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if old in data and b"\0" not in data:
            mode = path.stat().st_mode
            path.write_bytes(data.replace(old, new))
            path.chmod(mode & 0o7777)


def _open_up(root: Path) -> None:
    """Readable (and directories searchable) by every uid, writable by none but the builder."""
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                os.chmod(path, (mode | 0o444 | (0o111 if mode & 0o100 else 0)) & 0o755)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else ""


# --- the command line used by .ci/run ----------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sandpool.providers.local.environments",
        description="Build the local sandboxes' environments (once per lock) and print the `python` "
                    "environment's interpreter on stdout; progress goes to stderr.")
    parser.add_argument("--requirements", type=Path, default=None,
                        help="lock of the python environment (default: deploy/requirements/sandbox.txt)")
    parser.add_argument("--pools-file", type=Path, default=None, help="also build the environments it declares")
    parser.add_argument("--environments-dir", type=Path, default=None, help="the cache (default as the provider's)")
    args = parser.parse_args(argv)
    privileged = os.geteuid() == 0
    cache_dir = args.environments_dir or default_cache_dir(privileged)
    lock = args.requirements or default_lock()
    specs = {}
    if args.pools_file is not None:
        from sandpool.core.settings import ConfigurationError

        try:
            specs = declared(args.pools_file)
        except ConfigurationError as exc:
            print(f"environments: {exc}", file=sys.stderr)
            return 1
    if BUILTIN not in specs:
        if lock is None:
            print("environments: no lock for the python environment: pass --requirements", file=sys.stderr)
            return 1
        specs[BUILTIN] = EnvironmentSpec(BUILTIN, lock.absolute())
    try:
        base = base_python(privileged)
        built = {name: ensure(spec, cache_dir, base, progress=lambda line: print(line, file=sys.stderr, flush=True))
                 for name, spec in specs.items()}
    except EnvironmentUnavailable as exc:
        print(f"environments: {exc}", file=sys.stderr)
        return 1
    print(built[BUILTIN].python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
