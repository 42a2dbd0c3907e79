"""Egress from real local sandboxes: the only way out is the relayed egress proxy, and a credential admits
something only while the lease binds it.

The local provider as the scheduler runs it (the zygote, every isolation layer,
`--egress-socket`), a real `sandpool egress` proxy in the test's event loop on a
Unix socket, a real Redis, and the scheduler's own lease and release scripts.
What the sandbox runs is the code a tenant would send, through its agent. The
outside world is an HTTPS origin on the host's loopback behind a counting tap;
the proxy's resolver maps the test names (tests/egress/origins.py). The whole
stack with tokens, two workspaces and `sandpool up` is tests/e2e/test_egress_up.py.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from egress.origins import TEST_NAMES, Certificate, Origin, Tap, make_certificate
from testkit import eventually

from sandpool.controller.provider import PoolSpec, SandboxInfo
from sandpool.core.serve import bind
from sandpool.egress.server import EgressProxy
from sandpool.egress.serving import bind_unix, build_resolver
from sandpool.egress.settings import EgressSettings
from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings
from sandpool.state import Keys, close, connect
from sandpool.state.egress import EgressStore
from sandpool.state.sandboxes import SandboxStore
from sandpool.state.sessions import Leased, SessionLimits, SessionStore

pytestmark = pytest.mark.isolation
POOL = PoolSpec(name="default", image="python")
LIMITS = SessionLimits(idle_timeout_seconds=300, max_lifetime_seconds=3600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)
OVERRIDES = [f"{name}=127.0.0.1" for name in TEST_NAMES] + [
    "metadata.example.test=169.254.169.254", "private.example.test=10.1.2.3", "loopback.example.test=127.0.0.1"]


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="spe", dir="/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    return make_certificate(tmp_path_factory.mktemp("cert"))


@dataclass
class World:
    provider: LocalProvider
    proxy: EgressProxy
    sessions: SessionStore
    sandboxes: SandboxStore
    egress: EgressStore
    keys: Keys
    origin: Origin
    tap: Tap
    certificate: Certificate

    async def sandbox(self, sandbox_id: str) -> SandboxInfo:
        info = await self.provider.create(POOL, sandbox_id)
        assert info.egress_digest and len(info.egress_digest) == 64
        now = time.time()
        assert await self.sandboxes.register_starting(sandbox_id, pool="default", image="python", ceiling=100,
                                                      now=now, owner="tests")
        assert await self.sandboxes.publish_ready(sandbox_id, pool="default", address=info.address or "",
                                                  secret=info.secret or "", now=now,
                                                  egress_digest=info.egress_digest)
        return info

    async def lease(self, session: str, workspace: str, allow: list[str]) -> Leased:
        leased = await self.sessions.lease(session_id=session, workspace=workspace, pool="default", image="python",
                                           now=time.time(), limits=LIMITS, workspace_limits={}, egress_allow=allow)
        assert isinstance(leased, Leased), leased
        return leased

    def url(self, path: str, name: str = "files.example.test") -> str:
        return f"https://{name}:{self.tap.port}{path}"


@pytest.fixture
async def make_world(base: Path, redis_url: str, redis_prefix: str,
                     certificate: Certificate) -> AsyncIterator[Any]:
    made: list[tuple[World, Any]] = []

    async def make(*, loopback: bool) -> World:
        origin = Origin(tls=certificate.server_context())
        tap = Tap(origin.port)
        socket_path = base / f"egress-{len(made)}.sock"
        settings = EgressSettings(redis_url=redis_url, redis_prefix=redis_prefix, resolve_overrides=OVERRIDES,
                                  egress_allow_ceiling=[f"*:{tap.port}"], unsafe_allow_loopback_for_tests=loopback,
                                  unsafe_mode="tests" if loopback else "", shutdown_grace_seconds=0.2)
        client = connect(redis_url, timeout=2.0)
        keys = Keys(redis_prefix)
        store = EgressStore(client, keys)
        proxy = EgressProxy(settings, store=store, resolver=build_resolver(settings))
        await proxy.start([bind("127.0.0.1", 0), bind_unix(socket_path)])
        provider = LocalProvider(LocalProviderSettings(data_dir=base / f"data-{len(made)}", workspace_size_mb=16,
                                                       egress_socket=socket_path))
        await provider.start()
        world = World(provider, proxy, SessionStore(client, keys), SandboxStore(client, keys, record_ttl_seconds=600),
                      store, keys, origin, tap, certificate)
        made.append((world, client))
        return world

    yield make
    for world, client in made:
        await world.provider.destroy_all()
        await world.provider.close()
        await world.proxy.aclose()
        await close(client)
        world.tap.close()
        world.origin.close()


async def run(info: SandboxInfo, code: str) -> dict[str, Any]:
    """Run Python in the sandbox through its agent; the JSON it printed."""
    assert info.address is not None
    transport = httpx.AsyncHTTPTransport(uds=info.address.removeprefix("unix://"))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox", timeout=60) as client:
        response = await client.post("/sessions/s/exec", headers={"Authorization": f"Bearer {info.secret}"},
                                     json={"tool": "code_execution", "input": {"code": code}})
    assert response.status_code == 200, response.text
    content = response.json()["result_block"]["content"]
    assert content["return_code"] == 0, content["stderr"]
    return json.loads(content["stdout"])


def fetch(world: World, *urls: str) -> str:
    """Code that GETs each URL with urllib (the proxy from the environment) and prints what happened."""
    return f"""
import json, ssl, urllib.request, urllib.error
open('ca.pem', 'w').write({world.certificate.cert.read_text()!r})
context = ssl.create_default_context(cafile='ca.pem')
out = []
for url in {list(urls)!r}:
    try:
        with urllib.request.urlopen(url, context=context, timeout=20) as response:
            out.append({{'status': response.status, 'length': len(response.read())}})
    except urllib.error.HTTPError as exc:
        out.append({{'status': exc.code}})
    except (urllib.error.URLError, OSError) as exc:
        out.append({{'error': str(getattr(exc, 'reason', exc))}})
print(json.dumps(out))
"""


DIRECT = """
import json, os, socket
out = {}
for name, family, address in [('host_loopback', socket.AF_INET, ('127.0.0.1', PORT)),
                              ('ip_literal', socket.AF_INET, ('1.1.1.1', 443)),
                              ('metadata', socket.AF_INET, ('169.254.169.254', 80)),
                              ('ipv6', socket.AF_INET6, ('2606:4700:4700::1111', 443))]:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        out[name] = s.connect_ex(address)
    except OSError as exc:
        out[name] = exc.errno
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    udp.sendto(b'x', ('8.8.8.8', 53))
    out['udp'] = 0
except OSError as exc:
    out['udp'] = exc.errno
try:
    socket.socket(socket.AF_UNIX).connect('/run/sandpool-egress/egress.sock')
    out['egress_socket'] = 0
except OSError as exc:
    out['egress_socket'] = exc.errno
out['interfaces'] = sorted(name for _, name in socket.if_nameindex())
print(json.dumps(out))
"""


async def settled(world: World, workspace: str) -> dict[str, str]:
    """The workspace's usage once every connection through the tap has been metered."""
    seen: dict[str, Any] = {}

    async def metered() -> dict[str, str] | None:
        seen["total"] = total = dict(await world.egress.redis.hgetall(world.keys.usage_total(workspace)))
        seen["tap"] = sent, received = world.tap.totals()
        return total if total.get("egress_bytes") == str(sent + received) and world.proxy.active == 0 else None

    return await eventually(metered, timeout=20, what="the usage to match the tap's bytes",
                            state=lambda: f"usage {seen.get('total')}, the tap's sent and received {seen.get('tap')}")


async def test_a_credential_works_only_while_its_lease_binds_it_and_only_through_the_proxy(make_world) -> None:
    world = await make_world(loopback=True)
    info = await world.sandbox("eg-one")
    allowed = world.url("/bytes/4321")

    # Warm: the credential is bound to nothing.
    [warm] = await run(info, fetch(world, allowed))
    assert "407" in warm["error"], warm
    assert world.tap.opened == 0

    # Leased: the allow-list holds, refusals name the policy, internal addresses stay refused.
    await world.lease("se-one", "ws-alpha", [f"files.example.test:{world.tap.port}",
                                             f"metadata.example.test:{world.tap.port}"])
    ok, other, metadata = await run(info, fetch(world, allowed, world.url("/bytes/1", "other.example.test"),
                                                world.url("/bytes/1", "metadata.example.test")))
    assert ok == {"status": 200, "length": 4321}
    assert "403" in other["error"] and "egress_allow" in other["error"] and "other.example.test" in other["error"]
    assert "403" in metadata["error"] and "metadata" in metadata["error"]
    usage = await settled(world, "ws-alpha")
    assert int(usage["egress_connections"]) == 1  # refusals cost nothing
    assert [seen.path for seen in world.origin.seen] == ["/bytes/4321"]

    # No route but the proxy: not the host's loopback, no address, no UDP, not the proxy's socket itself.
    direct = await run(info, DIRECT.replace("PORT", str(world.tap.port)))
    assert direct["interfaces"] == ["lo"]
    assert direct["host_loopback"] != 0 and direct["ip_literal"] != 0 and direct["metadata"] != 0
    assert direct["ipv6"] != 0 and direct["udp"] != 0
    assert direct["egress_socket"] == 13  # EACCES: only the agent's relay reaches it

    # Released: the same sandbox's credential admits nothing any more, at once.
    assert await world.sessions.release(session_id="se-one", workspace="ws-alpha", now=time.time(),
                                        mode="destroy") is not None
    [after] = await run(info, fetch(world, allowed))
    assert "407" in after["error"], after
    assert len(world.origin.seen) == 1


async def test_names_resolving_to_loopback_or_metadata_are_refused(make_world) -> None:
    """Without the test-only allowance, the address policy refuses the host's own loopback too, whatever
    name leads there (the origin is on loopback: nothing reaches it)."""
    world = await make_world(loopback=False)
    info = await world.sandbox("eg-two")
    await world.lease("se-two", "ws-beta", [f"{name}:{world.tap.port}" for name in
                                            ("files.example.test", "loopback.example.test", "metadata.example.test",
                                             "private.example.test")])
    answers = await run(info, fetch(world, *(world.url("/bytes/1", name) for name in (
        "files.example.test", "loopback.example.test", "metadata.example.test", "private.example.test"))))
    for answer in answers:
        assert "403" in answer["error"] and "address" in answer["error"], answer
    assert world.tap.opened == 0
