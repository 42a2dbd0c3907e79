"""`sandpool up`'s build step: the local sandboxes' environments, built on first use before anything starts.

The `python` environment (the sandbox image's lock) and any the pools file declares
are built into the shared cache once per lock (`providers/local/environments.py`),
with progress on stderr: one updating line on a terminal, the milestones otherwise.
The `python` one is handed to the controller as `--sandbox-python`. A build that
cannot work stops `up` in one line, before any process of the stack starts;
`--sandbox-python PATH` skips the build and runs sandboxed code on PATH instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from sandpool.core.settings import ConfigurationError, settings_from_args
from sandpool.providers.local import environments
from sandpool.providers.local.settings import LocalProviderSettings


class Progress:
    """Build progress on stderr: one line rewritten in place on a terminal, milestones elsewhere."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._open = False

    def __call__(self, line: str) -> None:
        if self.tty:
            self.stream.write(f"\r\033[Ksandpool up: {line}")
            self._open = True
        elif ": fetching " not in line:
            self.stream.write(f"sandpool up: {line}\n")
        self.stream.flush()

    def end(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def _fail(why: str) -> ConfigurationError:
    return ConfigurationError(f"the sandbox environment could not be built: {why}")


def specs(local: LocalProviderSettings) -> dict[str, environments.EnvironmentSpec]:
    """What to build: the environments the pools file declares, and `python` unless --sandbox-python is given."""
    try:
        found = environments.declared(local.pools_file) if local.pools_file is not None else {}
    except ConfigurationError as exc:
        raise ConfigurationError(f"the controller could not start: {exc}") from None
    if local.sandbox_python is not None:
        found.pop(environments.BUILTIN, None)
    elif environments.BUILTIN not in found:
        lock = local.sandbox_requirements or environments.default_lock()
        if lock is None:
            raise _fail("this install has no deploy/requirements/sandbox.txt (pass --sandbox-requirements LOCK, "
                        "or --sandbox-python PATH to run sandboxed code on an interpreter of your own)")
        found[environments.BUILTIN] = environments.EnvironmentSpec(environments.BUILTIN, Path(lock).absolute())
    return found


def prepare(args: argparse.Namespace, progress: Progress | None = None) -> dict[str, environments.Environment]:
    """Build (or find) every environment the stack needs; hand `python`'s interpreter on as --sandbox-python."""
    local = settings_from_args(LocalProviderSettings, args)
    if local.sandbox_python is not None:
        try:
            environments.probe(local.sandbox_python)
        except environments.EnvironmentUnavailable as exc:
            raise ConfigurationError(f"the controller could not start: --sandbox-python {exc}") from None
    wanted = specs(local)
    if not wanted:
        return {}
    progress = progress or Progress()
    built: dict[str, environments.Environment] = {}
    try:
        base = environments.base_python(local.privileged())
        for name, spec in wanted.items():
            built[name] = environments.ensure(spec, local.environments_cache(), base, progress=progress)
            _check_preimport(built[name])
    except environments.EnvironmentUnavailable as exc:
        raise _fail(str(exc).removeprefix("cannot build the sandbox environment ")) from None
    finally:  # also on Ctrl-C: the terminal's progress line is ended
        progress.end()
    if environments.BUILTIN in built:
        args.sandbox_python = built[environments.BUILTIN].python
    return built


def _check_preimport(environment: environments.Environment) -> None:
    """A `preimport` module the environment does not have is a typo: say so now, not never."""
    if not environment.preimport:
        return
    import subprocess

    code = "import importlib.util, sys\nfor n in sys.argv[1:]:\n    importlib.util.find_spec(n) or print(n)"
    try:
        done = subprocess.run([environment.python, "-I", "-c", code, *environment.preimport], capture_output=True,
                              text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise environments.EnvironmentUnavailable(f"{environment.name}: its preimport cannot be checked: {exc}") \
            from None
    missing = done.stdout.split() if done.returncode == 0 else list(environment.preimport)
    if missing:
        raise environments.EnvironmentUnavailable(
            f"{environment.name}: its preimport names modules it does not have: {', '.join(missing)}")
