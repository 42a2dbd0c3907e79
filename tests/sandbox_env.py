"""The sandbox environment for the tests: the built `python` one (numpy, pandas, ... ), or a tiny one made here.

A test never builds the real environment (that is pip installing the scientific
stack): `.ci/run` builds it and names its interpreter in SANDPOOL_TEST_SANDBOX_PYTHON;
without it, the tests that need it look in the default cache and skip with a
one-line reason when it is not there. The tiny environment is made offline from a
wheel written here, so the build itself is tested without any package index.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile
from pathlib import Path

import pytest

VARIABLE = "SANDPOOL_TEST_SANDBOX_PYTHON"
BUILD = "python -m sandpool.providers.local.environments"


def built_python() -> str | None:
    """The interpreter of the built `python` environment, if there is one."""
    named = os.environ.get(VARIABLE)
    if named:
        return named if os.access(named, os.X_OK) else None
    from sandpool.providers.local import environments

    lock = environments.default_lock()
    if lock is None:
        return None
    try:
        base = environments.base_python(os.geteuid() == 0)
        found = environments.find(environments.EnvironmentSpec(environments.BUILTIN, lock),
                                  environments.default_cache_dir(os.geteuid() == 0), base)
    except environments.EnvironmentUnavailable:
        return None
    return found.python if found is not None else None


def sandbox_python() -> str:
    """The built environment's interpreter, or a skip saying how to build it (never a build)."""
    python = built_python()
    if python is None:
        pytest.skip(f"sandbox environment unavailable: set {VARIABLE} (`.ci/run` builds it with {BUILD})")
    return python


def host_python() -> str:
    """What sandboxes ran on before environments: the built one when there is one, else the host's."""
    from sandpool.providers.local.settings import default_sandbox_python

    return built_python() or (default_sandbox_python(sys.executable) if os.geteuid() == 0 else None) \
        or sys.executable


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, name: str = "sandpool_probe_pkg", version: str = "1.0",
               source: str = "VALUE = 42\n") -> Path:
    """A pure-Python wheel holding one module `name` (what pip installs offline from a file)."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": source.encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sandpool-tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n",
    }
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def make_lock(directory: Path, *, name: str = "sandpool_probe_pkg", source: str = "VALUE = 42\n",
              bad_hash: bool = False) -> Path:
    """A requirements lock (with its hash) of one local wheel: an environment pip builds offline."""
    wheel = make_wheel(directory / "wheels", name=name, source=source)
    digest = "0" * 64 if bad_hash else hashlib.sha256(wheel.read_bytes()).hexdigest()
    lock = directory / f"{name}.txt"
    lock.write_text(f"{name} @ {wheel.as_uri()} \\\n    --hash=sha256:{digest}\n")
    return lock
