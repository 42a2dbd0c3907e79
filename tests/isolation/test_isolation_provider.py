"""The local provider with its default settings runs isolated sandboxes (the zygote), and
`--launcher subprocess` / `--isolation-disable` are honoured end to end."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandpool.controller.provider import PoolSpec
from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings

pytestmark = pytest.mark.isolation
POOL = PoolSpec(name="default", image="python")


@pytest.fixture
def data_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="spip", dir="/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _python(address: str, secret: str, code: str) -> dict[str, object]:
    transport = httpx.AsyncHTTPTransport(uds=address.removeprefix("unix://"))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox", timeout=60) as client:
        response = await client.post("/sessions/s/exec", headers={"Authorization": f"Bearer {secret}"},
                                     json={"tool": "code_execution", "input": {"code": code}})
    assert response.status_code == 200, response.text
    return json.loads(response.json()["result_block"]["content"]["stdout"])


PROBE = (
    "import os, json, socket, errno\n"
    "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
    "s = socket.socket(); s.settimeout(1)\n"
    "n = 0\n"
    "try:\n"
    "    with open('big', 'wb') as f:\n"
    "        while n < 256 << 20:\n"
    "            f.write(b'x' * (1 << 20)); f.flush(); n += 1 << 20\n"
    "except OSError as e:\n"
    "    pass\n"
    "print(json.dumps({'pid1': open('/proc/1/cmdline','rb').read().split(b'\\0')[0].decode(),\n"
    "    'procs': len([p for p in os.listdir('/proc') if p.isdigit()]), 'cwd': os.getcwd(),\n"
    "    'cap': status['CapEff'].strip(), 'seccomp': status['Seccomp'].strip(), 'nnp': status['NoNewPrivs'].strip(),\n"
    "    'net': s.connect_ex(('1.1.1.1', 53)), 'written': n}))\n"
)


async def test_default_provider_sandboxes_are_isolated(data_dir: Path) -> None:
    provider = LocalProvider(LocalProviderSettings(data_dir=data_dir, workspace_size_mb=8))
    await provider.start()
    try:
        described = provider.describe()
        assert described["launcher"] == "zygote" and described["namespaces"] is True
        assert described["warnings"] == []
        info = await provider.create(POOL, "iso-default")
        assert info.address is not None and info.secret is not None
        seen = await _python(info.address, info.secret, PROBE)
        assert seen["cwd"] == "/workspace" and seen["procs"] < 10
        assert (seen["cap"], seen["seccomp"], seen["nnp"]) == ("0000000000000000", "2", "1")
        assert seen["net"] != 0
        assert seen["written"] <= 8 << 20  # the provider's workspace cap holds inside the sandbox
        await provider.destroy("iso-default")
        assert await provider.list() == []
    finally:
        await provider.close()


async def test_subprocess_launcher_and_disabled_layers_are_honoured(data_dir: Path) -> None:
    plain = LocalProvider(LocalProviderSettings(data_dir=data_dir / "a", launcher="subprocess"))
    assert plain.describe()["launcher"] == "subprocess"
    await plain.close()

    provider = LocalProvider(LocalProviderSettings(data_dir=data_dir / "b", isolation_disable=["network"]))
    await provider.start()
    try:
        isolation = provider.describe()["isolation"]
        assert isinstance(isolation, dict) and "network" in isolation["missing"]
        info = await provider.create(POOL, "iso-net")
        assert info.address is not None and info.secret is not None
        seen = await _python(info.address, info.secret, PROBE.replace("('1.1.1.1', 53)", "('127.0.0.1', 9)"))
        assert seen["net"] in (111,)  # ECONNREFUSED: the host's loopback is reachable without the layer
        assert seen["procs"] < 10  # the other layers stay on
        await provider.destroy("iso-net")
    finally:
        await provider.close()
