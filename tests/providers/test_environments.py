"""Sandbox environments: built once from a lock with hashes, atomically, readable by every uid, found after.

Every build here is real (a venv, then pip with `--require-hashes`) from a wheel the
test writes, so nothing reaches a package index; the real `python` environment is
built by `.ci/run`, never by a test.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
from sandbox_env import make_lock

from sandpool.controller.templates import load_environments, load_pools
from sandpool.core.settings import ConfigurationError
from sandpool.providers.local import environments
from sandpool.providers.local.environments import EnvironmentSpec, EnvironmentUnavailable

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base() -> environments.PythonInfo:
    return environments.base_python(os.geteuid() == 0)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, base: environments.PythonInfo) -> environments.Environment:
    """One tiny environment for the module (a build costs a few seconds)."""
    root = tmp_path_factory.mktemp("env")
    spec = EnvironmentSpec("tiny", make_lock(root))
    return environments.build(spec, root / "cache", base)


def test_the_python_environment_is_the_sandbox_images_lock() -> None:
    assert environments.default_lock() == REPO / "deploy" / "requirements" / "sandbox.txt"
    assert "COPY deploy/requirements/sandbox.txt" in (REPO / "deploy" / "Dockerfile.sandbox").read_text()


def test_a_built_environment_runs_its_packages_and_is_found_again(built: environments.Environment,
                                                                   base: environments.PythonInfo) -> None:
    done = subprocess.run([built.python, "-c", "import sandpool_probe_pkg, sys; print(sandpool_probe_pkg.VALUE, "
                                               "sys.prefix)"], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["42", built.path]
    assert built.roots[0] == built.path and base.base_prefix in built.roots
    lines: list[str] = []
    spec = EnvironmentSpec("tiny", Path(built.details["lock"]))
    again = environments.ensure(spec, Path(built.path).parent, base, progress=lines.append)
    assert again.path == built.path and again.details["built_at"] == built.details["built_at"]
    assert lines == []  # found, not built
    assert not list(Path(built.path).parent.glob(".*.build-*"))


def test_the_cache_key_follows_the_lock_and_the_base_python(base: environments.PythonInfo) -> None:
    key = environments.environment_key
    lock = b"numpy==2.4.6 --hash=sha256:00\n"
    assert key(lock, base) == key(bytes(lock), base)
    assert key(lock, base) != key(lock.replace(b"2.4.6", b"2.4.7"), base)
    newer = environments.PythonInfo(base.executable, base.version + "1", base.prefix, base.base_prefix)
    assert key(lock, base) != key(lock, newer)
    assert key(lock, base).startswith(f"py{base.minor}-")


def test_nothing_names_the_temporary_build_directory(built: environments.Environment) -> None:
    root = Path(built.path)
    for path in [*(root / "bin").iterdir(), root / "pyvenv.cfg", *(root / environments.MATPLOTLIB_CACHE).iterdir()]:
        if path.is_file() and not path.is_symlink():
            assert b".build-" not in path.read_bytes(), path
    assert (root / "bin" / "pip").read_text().splitlines()[0] == f"#!{built.python}"


def test_every_uid_can_read_an_environment_and_none_can_change_it(built: environments.Environment) -> None:
    for directory, _dirs, files in os.walk(built.path):
        assert os.stat(directory).st_mode & 0o777 == 0o755, directory
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                assert mode & 0o004 and not mode & 0o022, path


def test_pip_in_an_environment_refuses_to_install_and_says_there_is_no_network(
        built: environments.Environment) -> None:
    bin_dir = Path(built.python).parent
    for argv in ([str(bin_dir / "pip"), "install", "requests"], [built.python, "-m", "pip", "install", "numpy"],
                 [str(bin_dir / "pip3"), "download", "x"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, argv
        assert "no network access" in done.stderr and "docs/sandboxes.md" in done.stderr
    listed = subprocess.run([str(bin_dir / "pip"), "list"], capture_output=True, text=True, check=True).stdout
    assert "sandpool_probe_pkg 1.0" in " ".join(listed.split())
    frozen = subprocess.run([str(bin_dir / "pip"), "freeze"], capture_output=True, text=True, check=True).stdout
    assert frozen.split() == ["sandpool_probe_pkg==1.0"]
    shown = subprocess.run([built.python, "-m", "pip", "show", "sandpool-probe-pkg"], capture_output=True, text=True)
    assert shown.returncode == 0 and "Version: 1.0" in shown.stdout


def test_a_lock_whose_hashes_do_not_match_fails_in_one_line_and_leaves_nothing(
        tmp_path: Path, base: environments.PythonInfo) -> None:
    spec = EnvironmentSpec("tampered", make_lock(tmp_path, bad_hash=True))
    cache = tmp_path / "cache"
    with pytest.raises(EnvironmentUnavailable) as err:
        environments.build(spec, cache, base)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("cannot build the sandbox environment tampered from ")
    assert "DO NOT MATCH THE HASHES" in message and "pip's full output: " in message
    assert environments.find(spec, cache, base) is None
    assert [p.name for p in cache.iterdir() if not p.name.endswith((".lock", ".log"))] == []


def test_a_crashed_build_is_never_used_and_the_next_build_replaces_it(
        tmp_path: Path, base: environments.PythonInfo) -> None:
    spec = EnvironmentSpec("tiny", make_lock(tmp_path))
    cache = tmp_path / "cache"
    final = environments.location(spec, cache, base)
    crashed = final.with_name(f".{final.name}.build-999999")
    (crashed / "bin").mkdir(parents=True)
    (final / "bin").mkdir(parents=True)  # a half environment at the final place: no marker
    os.symlink(base.executable, final / "bin" / "python")
    assert environments.find(spec, cache, base) is None
    built = environments.ensure(spec, cache, base)
    assert built.path == str(final) and (final / environments.MARKER).is_file()
    assert not crashed.exists()


def test_two_builders_at_once_build_one_environment(tmp_path: Path, base: environments.PythonInfo) -> None:
    spec = EnvironmentSpec("tiny", make_lock(tmp_path))
    cache = tmp_path / "cache"
    lines: list[str] = []
    results: list[environments.Environment] = []
    threads = [threading.Thread(target=lambda: results.append(environments.ensure(spec, cache, base,
                                                                                  progress=lines.append)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 2 and results[0].path == results[1].path
    assert sum(line.startswith("environment tiny: building from") for line in lines) == 1, lines


def test_an_unusable_cache_dir_is_named(tmp_path: Path, base: environments.PythonInfo) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(EnvironmentUnavailable, match=r"cannot use the environments cache .*--environments-dir"):
        environments.build(EnvironmentSpec("tiny", make_lock(tmp_path)), blocker / "cache", base)


# --- the pools file's `environments:` ---------------------------------------------------------


def _pools_file(tmp_path: Path, environments_yaml: str) -> Path:
    path = tmp_path / "pools.yaml"
    path.write_text(environments_yaml + "pools:\n  - {name: ml, image: python-ml}\n")
    return path


def test_the_pools_file_declares_environments_with_locks_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / "ml.txt").write_text("")
    path = _pools_file(tmp_path, "environments:\n  - name: python-ml\n    requirements: locks/ml.txt\n"
                                 "    preimport: [numpy, matplotlib.pyplot]\n")
    [declared] = load_environments(path)
    assert declared.name == "python-ml" and declared.requirements == tmp_path / "locks" / "ml.txt"
    assert declared.preimport == ["numpy", "matplotlib.pyplot"]
    assert [p.image for p in load_pools(path)] == ["python-ml"]
    assert environments.declared(path)["python-ml"].preimport == ("numpy", "matplotlib.pyplot")


@pytest.mark.parametrize(("text", "says"), [
    ("environments:\n  - {name: Bad Name, requirements: x.txt}\n", "environments[0].name"),
    ("environments:\n  - {name: a, requirements: x.txt}\n  - {name: a, requirements: x.txt}\n", "appears twice"),
    ("environments:\n  - {name: a, requirements: x.txt, preimport: ['os; rm']}\n", "environments[0].preimport"),
    ("environments:\n  - {name: a, requirement: x.txt}\n", "environments[0].requirement"),
    ("environments:\n  - {name: a, requirements: missing.txt}\n", "environments[0].requirements: "),
])
def test_a_bad_environment_is_named(tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(ConfigurationError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_environments(_pools_file(tmp_path, text))
