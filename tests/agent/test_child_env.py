"""The environment of sandboxed code: PATH from the sandbox interpreter, a private matplotlib directory.

In an image the sandbox interpreter is a venv's (`/opt/sandpool/bin/python`); bash must
find that `python` (with numpy), not the base system's. matplotlib must neither write
into the workspace nor rebuild its font cache on the first import.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

import pytest
from agent_harness import content, start_agent

from sandpool.agent import hardening
from sandpool.agent.hardening import ChildPolicy, child_env, child_path, matplotlib_dir
from sandpool.agent.settings import AgentSettings

NO_DROP = ChildPolicy(uid=None, gid=None, nproc=None, nofile=None, fsize=None, address_space=None)


def test_path_leads_with_the_interpreter_directory_then_the_system() -> None:
    path = child_path("/opt/env/bin/python").split(":")
    assert path[0] == "/opt/env/bin"
    assert path[1:] == list(hardening.SYSTEM_PATH)


def test_path_keeps_each_directory_once_and_does_not_resolve_symlinks(tmp_path: Path) -> None:
    system = child_path("/usr/bin/python3").split(":")
    assert system[0] == "/usr/bin" and sorted(system) == sorted(hardening.SYSTEM_PATH)
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(sys.executable)
    assert child_path(str(venv_python)).split(":")[0] == str(venv_python.parent)


def test_a_bare_interpreter_name_adds_nothing_to_path() -> None:
    assert child_path("python3") == ":".join(hardening.SYSTEM_PATH)


def test_env_carries_mplconfigdir_only_when_there_is_one() -> None:
    assert "MPLCONFIGDIR" not in child_env("/w", python="/e/bin/python")
    env = child_env("/w", python="/e/bin/python", mplconfigdir="/tmp/sandpool-mpl-x")
    assert env["MPLCONFIGDIR"] == "/tmp/sandpool-mpl-x"
    assert env["HOME"] == "/w" and env["MPLBACKEND"] == "Agg"
    assert not any(k.startswith("SANDPOOL") for k in env)


def test_settings_default_to_the_agents_own_interpreter() -> None:
    assert AgentSettings().sandbox_python() == sys.executable
    assert AgentSettings(python_executable="/e/bin/python").sandbox_python() == "/e/bin/python"


@pytest.fixture
def own_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_matplotlib_dir_is_private_in_the_temp_dir_and_seeded_with_the_font_cache(tmp_path: Path,
                                                                                  own_tempdir: Path) -> None:
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "fontlist-v390.json").write_text('{"_version": 390}')
    (seed / "matplotlibrc").write_text("backend: TkAgg\n")  # only the font cache is copied
    made = Path(matplotlib_dir(seed, NO_DROP) or "")
    assert made.parent == own_tempdir
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert sorted(p.name for p in made.iterdir()) == ["fontlist-v390.json"]
    assert (made / "fontlist-v390.json").read_text() == '{"_version": 390}'


def test_matplotlib_dir_without_a_seed_is_empty(own_tempdir: Path) -> None:
    made = Path(matplotlib_dir(None, NO_DROP) or "")
    assert made.is_dir() and not any(made.iterdir())


def test_matplotlib_dir_falls_back_to_tmp_when_the_temp_dir_is_gone(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A TMPDIR found before a sandbox root was swapped in may not exist in it: /tmp is the sandbox's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    made = Path(matplotlib_dir(None, NO_DROP) or "")
    try:
        assert made.parent == Path("/tmp") and made.is_dir()
    finally:
        made.rmdir()


def _fake_env(tmp_path: Path) -> Path:
    """A directory like a venv's bin: a `python` and a console script only it has."""
    bindir = tmp_path / "env" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").symlink_to(sys.executable)
    tool = bindir / "sandpool-env-tool"
    tool.write_text("#!/bin/sh\necho from-the-env\n")
    tool.chmod(0o755)
    return bindir / "python"


def test_sandboxed_code_sees_the_interpreters_environment_and_a_private_matplotlib_dir(tmp_path: Path) -> None:
    python = _fake_env(tmp_path)
    seed = tmp_path / "mpl-seed"
    seed.mkdir()
    (seed / "fontlist-v390.json").write_text("{}")
    agent_tmp = tmp_path / "agent-tmp"
    agent_tmp.mkdir()
    a = start_agent(tmp_path, "--python-executable", str(python), "--matplotlib-cache", str(seed),
                    env={"TMPDIR": str(agent_tmp)})
    try:
        found = content(a.sh("command -v python; sandpool-env-tool; echo \"$PATH\""))
        lines = found["stdout"].splitlines()
        assert lines[0] == str(python)
        assert lines[1] == "from-the-env"
        assert lines[2].split(":")[0] == str(python.parent)
        probe = content(a.py(
            "import os, sys\n"
            "d = os.environ['MPLCONFIGDIR']\n"
            "print(sys.executable)\n"
            "print(d)\n"
            "print(sorted(os.listdir(d)))\n"
            "open(os.path.join(d, 'probe'), 'w').close()\n"
            "print(os.access(d, os.W_OK))\n"))
        executable, mpldir, listing, writable = probe["stdout"].splitlines()
        assert executable == str(python)
        assert Path(mpldir).parent == agent_tmp  # the sandbox's temp dir, not the workspace
        assert not Path(mpldir).is_relative_to(a.workspace)
        assert listing == "['fontlist-v390.json']" and writable == "True"
        assert list(a.workspace.iterdir()) == []
    finally:
        a.stop()
    assert not Path(mpldir).exists(), "the agent removes its matplotlib directory on the way out"


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_the_matplotlib_dir_belongs_to_the_sandbox_uid_when_the_agent_drops(tmp_path: Path,
                                                                           own_tempdir: Path) -> None:
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "fontlist-v390.json").write_text("{}")
    policy = ChildPolicy(uid=65534, gid=65534, nproc=None, nofile=None, fsize=None, address_space=None)
    made = Path(matplotlib_dir(seed, policy) or "")
    for entry in (made, made / "fontlist-v390.json"):
        assert (entry.stat().st_uid, entry.stat().st_gid) == (65534, 65534)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700  # no other uid (another sandbox) gets in
