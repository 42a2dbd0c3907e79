"""Detection: each layer reported missing when it is (simulated by configuration, or by
running detection without root), one line for what is active, a loud warning for
what is not; and the zygote's channel refusing malformed requests without leaking."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import socket
from pathlib import Path

import pytest
from testkit import in_forked_child, survivors

from sandpool.providers.local import zygote_protocol
from sandpool.providers.local.isolation import detect
from sandpool.providers.local.zygote import ZygoteClient, ZygoteError

from .harness import Harness

pytestmark = pytest.mark.isolation

DEGRADABLE = ("namespaces", "filesystem", "network", "cgroups", "unprivileged_uid", "seccomp")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "sandpool.isolation" and r.levelno == logging.WARNING]


def test_full_host_logs_one_line_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sandpool.isolation")
    h = Harness()
    try:
        infos = [r.getMessage() for r in caplog.records if r.name == "sandpool.isolation"
                 and r.levelno == logging.INFO]
        assert len(infos) == 1 and infos[0].startswith("isolation active: namespaces")
        for name in detect.LAYERS:
            assert name in infos[0]
        assert _warnings(caplog) == []
    finally:
        h.close()


@pytest.mark.parametrize("missing", [("seccomp",), ("cgroups",), ("network",), ("unprivileged_uid",),
                                     DEGRADABLE])
def test_disabled_layers_are_reported_missing_and_really_off(
        caplog: pytest.LogCaptureFixture, missing: tuple[str, ...]) -> None:
    caplog.set_level(logging.INFO, logger="sandpool.isolation")
    h = Harness(disabled=frozenset(missing))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        assert sorted(h.report.missing) == sorted(missing)
        assert all(h.report.to_dict()["missing"][m] == "disabled by configuration" for m in missing)
        warnings = _warnings(caplog)
        assert len(warnings) == 1 and warnings[0].startswith("ISOLATION MISSING")
        for name in missing:
            assert f"{name}: disabled by configuration" in warnings[0]
        for name in set(detect.LAYERS) - set(missing):
            assert name not in warnings[0].split(".")[0]
        assert h.launcher.describe()["namespaces"] is ("namespaces" not in missing)

        sandbox = h.start()
        probe = sandbox.python(
            "import os, json, socket\n"
            "agent = dict(l.split(':\\t', 1) for l in open('/proc/1/status').read().splitlines() if ':\\t' in l)\n"
            "res = {'uid': os.getuid(), 'agent_seccomp': agent.get('Seccomp', '').strip(),\n"
            "       'agent_name': agent.get('Name', '').strip(),\n"
            "       'ifaces': len(open('/proc/net/dev').readlines()) - 2,\n"
            "       'cgroup': open('/proc/self/cgroup').read(), 'mpl': os.environ.get('MPLCONFIGDIR')}\n"
            "s = socket.socket(); s.settimeout(2)\n"
            f"res['connect'] = s.connect_ex(('127.0.0.1', {port}))\n"
            "print(json.dumps(res))")
        res = json.loads(probe["stdout"])
        groups = [Path(b) / sandbox.sandbox_id for b in h.launcher.client.cgroup_bases]
        if "seccomp" in missing:
            assert res["agent_seccomp"] in ("0", "")  # the agent process itself runs unfiltered
        elif "namespaces" not in missing:
            assert res["agent_seccomp"] == "2"
        if "unprivileged_uid" in missing:
            assert res["uid"] == 0
        else:
            assert res["uid"] == sandbox.uid
        if "network" in missing:
            assert res["connect"] == 0  # the host's loopback, where the scheduler and Redis listen
        else:
            assert res["ifaces"] == 1 and res["connect"] != 0
        if "filesystem" in missing:  # the agent's temporary directories are in the sandbox's, not the host's /tmp
            assert Path(res["mpl"]).parent == sandbox.directory / "tmp"
        if "cgroups" in missing:
            assert groups == [] and h.launcher.client.cgroup_bases == []
        else:
            assert groups and all(g.exists() for g in groups)
        h.kill(sandbox)
    finally:
        listener.close()
        h.close()


def test_detection_without_root_names_what_is_missing() -> None:
    """Run detection as an unprivileged uid (a forked child that dropped root for good)."""
    def detect_as_nobody() -> dict[str, object]:
        os.setgroups([])
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)
        report, manager = detect.detect()
        return {"report": report.to_dict(), "manager": manager is not None}

    data = in_forked_child(detect_as_nobody)
    missing = data["report"]["missing"]
    assert {"namespaces", "filesystem", "network", "cgroups", "unprivileged_uid"} <= set(missing)
    assert "seccomp" in data["report"]["active"]  # needs no privilege
    assert "not root" in missing["unprivileged_uid"]
    assert data["manager"] is False


async def test_malformed_requests_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    client = ZygoteClient(tmp_path / "z")
    await client.start()
    try:
        workspace = tmp_path / "ws"
        workspace.mkdir()
        sock_dir = tmp_path / "sb"
        sock_dir.mkdir()
        good = {"socket_path": str(sock_dir / "agent.sock"), "workspace": str(workspace), "uid": 1_700_001,
                "secret": "s" * 20, "limits": {"memory_bytes": 64 << 20, "pids_max": 64}, "agent": {}}
        bad_cases = [
            ("../escape", {}, "bad sandbox id"),
            ("", {}, "bad sandbox id"),
            ("ok1", {"limits": {"memory_bytes": "lots"}}, "limits must be integers"),
            ("ok2", {"limits": {"pids_max": -1}}, "limits must be positive"),
            ("ok3", {"uid": "root"}, "uid must be a positive integer"),
            ("ok4", {"uid": 0}, "uid must be a positive integer"),
            ("ok5", {"workspace": "relative/dir"}, "workspace must be an absolute path"),
        ]
        for sandbox_id, override, expected in bad_cases:
            with pytest.raises(ZygoteError, match=expected):
                await client.launch(sandbox_id, **{**good, **override})
        # No secret descriptor at all.
        reply = await client.request({"op": "launch", "sandbox_id": "ok6", **{k: v for k, v in good.items()
                                                                            if k != "secret"}})
        assert reply["ok"] is False and "descriptor" in reply["error"]
        # Three descriptors (one more than the secret and the readiness pipe): refused, and a
        # refused launch keeps no copy of a readiness pipe either: end-of-file once ours is closed.
        without_secret = {k: v for k, v in good.items() if k != "secret"}
        for sandbox_id, extra, fds in (("ok6", {}, 3), ("ok3", {"uid": "root"}, 2)):
            ready_r, ready_w = os.pipe()
            secret_fd = zygote_protocol.secret_fd("s" * 20)
            try:
                reply = await client.request({"op": "launch", "sandbox_id": sandbox_id, **without_secret, **extra},
                                             (secret_fd, ready_w, ready_w)[:fds])
            finally:
                os.close(secret_fd)
                os.close(ready_w)
            assert reply["ok"] is False and ("descriptor" if fds == 3 else "uid") in reply["error"]
            assert select.select([ready_r], [], [], 30)[0] and os.read(ready_r, 8) == b""
            os.close(ready_r)
        reply = await client.request({"op": "format-disk"})
        assert reply["ok"] is False and "unknown op" in reply["error"]
        # Nothing was left behind, and the zygote still works.
        assert await client.list() == []
        for base in client.cgroup_bases:
            assert list(Path(base).iterdir()) == [] or all(not p.is_dir() for p in Path(base).iterdir())
        await client.launch("ok7", **good)
        with pytest.raises(ZygoteError, match="already in use"):
            await client.launch("ok7", **good)
        assert [s["sandbox_id"] for s in await client.list()] == ["ok7"]
        assert await client.kill(sandbox_id="ok7") == "contained"  # its PID namespace (or cgroup) emptied
        assert await client.kill(sandbox_id="ok7") == "unknown"  # idempotent
    finally:
        await client.close()
    for base in client.cgroup_bases:
        assert not Path(base).exists()


async def test_garbage_on_the_channel_stops_the_zygote_and_its_sandboxes(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    client = ZygoteClient(tmp_path / "z")
    await client.start()
    assert client.sock is not None and client.proc is not None
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (tmp_path / "sb").mkdir()
    reply = await client.launch("victim", socket_path=str(tmp_path / "sb" / "agent.sock"),
                                workspace=str(workspace), uid=1_700_002, secret="x" * 20,
                                limits={"pids_max": 64}, agent={})
    sandbox_pid = int(reply["pid"])
    client.sock.send(b"\xff not json")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while client.proc.poll() is None and loop.time() < deadline:  # noqa: ASYNC110 - a Popen exit is not awaitable
        await asyncio.sleep(0.02)
    assert client.proc.poll() is not None
    status = f"/proc/{sandbox_pid}/status"
    assert not os.path.exists(status) or "zombie" in open(status).read()  # noqa: ASYNC230 - a /proc file
    with pytest.raises(ZygoteError):
        await client.list()
    await client.close()
    for base in client.cgroup_bases:
        assert not Path(base).exists()


def test_a_dead_zygote_takes_its_sandboxes_and_is_replaced() -> None:
    h = Harness(restart_interval=0)
    try:
        sandbox = h.start()
        old = h.launcher.client
        old_groups = [Path(b) for b in old.cgroup_bases]
        assert old.proc is not None
        os.kill(old.proc.pid, signal.SIGKILL)
        assert survivors([sandbox.handle.pid], timeout=10) == []  # PDEATHSIG: nothing outlives the zygote
        h.live.remove(sandbox)
        again = h.start()  # a new zygote is started on demand
        assert h.launcher.client is not old and h.launcher.client.alive
        assert again.python("print(2 + 2)")["stdout"].strip() == "4"
        assert not any(g.exists() for g in old_groups)  # the old zygote's groups were cleaned
    finally:
        h.close()


