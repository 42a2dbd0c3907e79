"""Bytes metered exactly: the usage counters equal what the outside saw, byte for byte.

The tap in front of each origin counts what the proxy sent it (`out`: from the
sandbox) and what it sent the proxy (`in`: towards the sandbox), TLS records
and HTTP heads included; `egress_bytes` is their sum, per workspace, in the
totals and today's hash, with one `egress` usage event per connection. What is
metered is what crossed to the outside: a plain-HTTP head the proxy rewrites
for the client counts as the origin sent it.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from sandpool.state.keys import utc_day

from .conftest import Egress, Outside, basic
from .origins import Tap


async def settled(egress: Egress, tap: Tap, connections: int, workspace: str, *, flows: int | None = None
                  ) -> dict[str, str]:
    """The workspace's usage once the tap saw `flows` finished connections (default: `connections`) and
    the workspace's `connections` were metered."""
    for _ in range(600):
        with tap.lock:
            done = len(tap.flows) >= (flows or connections)
        usage = await egress.usage(workspace)
        if done and int(usage.get("egress_connections", 0)) >= connections and not egress.proxy.meter.in_flight:
            return usage
        await asyncio.sleep(0.05)
    raise AssertionError(f"{connections} connections were not metered: {await egress.usage(workspace)}")


async def test_https_bytes_are_metered_exactly(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    for _ in range(2):  # two clients, two tunnels
        async with httpx.AsyncClient(proxy=egress.url(bound.credential), verify=outside.certificate.client_context(),
                                     trust_env=False) as client:
            assert len((await client.get(outside.https_url("/bytes/250000"))).content) == 250_000
            assert (await client.post(outside.https_url("/echo"), content=b"u" * 40_000)).json()["received"] == 40_000
    usage = await settled(egress, outside.https_tap, 2, bound.workspace)
    sent, received = outside.https_tap.totals()
    assert received > 500_000 and sent > 80_000  # the payloads, plus TLS and HTTP overhead
    assert int(usage["egress_bytes_in"]) == received
    assert int(usage["egress_bytes_out"]) == sent
    assert int(usage["egress_bytes"]) == sent + received
    assert int(usage["egress_connections"]) == 2
    day = await egress.store.redis.hgetall(egress.keys.usage_day(bound.workspace, utc_day(time.time())))
    assert int(day["egress_bytes"]) == sent + received

    events = await egress.events()
    assert len(events) == 2
    assert {e["session"] for e in events} == {bound.session}
    assert {(e["host"], e["port"]) for e in events} == {("files.example.test", str(outside.https_tap.port))}
    assert sum(int(e["egress_bytes_in"]) for e in events) == received
    assert sum(int(e["egress_bytes_out"]) for e in events) == sent
    assert sorted(int(e["egress_bytes_in"]) for e in events) == sorted(f.to_proxy for f in outside.https_tap.flows)


async def test_plain_http_bytes_are_metered_exactly(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.http_tap.port}"])
    body = b"p" * 12_345
    head = (f"POST {outside.http_url('/echo')} HTTP/1.1\r\nHost: files.example.test\r\n"
            f"Proxy-Authorization: {basic(bound.credential)}\r\nProxy-Connection: keep-alive\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", egress.port)
    writer.write(head + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert b'"received": 12345' in answer
    usage = await settled(egress, outside.http_tap, 1, bound.workspace)
    sent, received = outside.http_tap.totals()
    # the client got the origin's answer, told that the connection ends with it
    assert answer.lower().count(b"\r\nconnection: close\r\n") == 1
    assert len(answer) - len(b"Connection: close\r\n") <= received <= len(answer)
    assert sent < len(head) + len(body)  # the credential and hop-by-hop headers were not sent on
    assert int(usage["egress_bytes_in"]) == received
    assert int(usage["egress_bytes_out"]) == sent


async def test_workspaces_are_metered_apart_and_refusals_cost_nothing(egress: Egress, outside: Outside) -> None:
    port = outside.https_tap.port
    one = await egress.bind_session([f"files.example.test:{port}"], workspace="ws-one")
    two = await egress.bind_session([f"files.example.test:{port}"], workspace="ws-two")
    async with httpx.AsyncClient(proxy=egress.url(one.credential), verify=outside.certificate.client_context(),
                                 trust_env=False) as client:
        await client.get(outside.https_url("/bytes/1000"))
    async with httpx.AsyncClient(proxy=egress.url(two.credential), verify=outside.certificate.client_context(),
                                 trust_env=False) as client:
        await client.get(outside.https_url("/bytes/90000"))
        try:
            await client.get(outside.https_url("/bytes/1", name="other.example.test"))
        except httpx.ProxyError:
            pass
    usage_one = await settled(egress, outside.https_tap, 1, "ws-one", flows=2)
    usage_two = await settled(egress, outside.https_tap, 1, "ws-two", flows=2)
    flows = sorted(outside.https_tap.flows, key=lambda f: f.to_proxy)
    assert int(usage_one["egress_bytes_in"]) == flows[0].to_proxy
    assert int(usage_two["egress_bytes_in"]) == flows[1].to_proxy
    assert int(usage_one["egress_connections"]) == 1 and int(usage_two["egress_connections"]) == 1
    assert await egress.store.redis.sismember(egress.keys.usage_workspaces, "ws-one")


async def test_a_policy_change_applies_to_new_sessions(egress: Egress, outside: Outside) -> None:
    """The allow-list is bound at lease time: a session keeps what it was leased with; the next one gets
    the new list."""
    port = outside.https_tap.port
    before = await egress.bind_session([f"files.example.test:{port}"])
    after = await egress.bind_session([f"other.example.test:{port}"])
    async with httpx.AsyncClient(proxy=egress.url(before.credential), verify=outside.certificate.client_context(),
                                 trust_env=False) as old, \
            httpx.AsyncClient(proxy=egress.url(after.credential), verify=outside.certificate.client_context(),
                              trust_env=False) as new:
        assert (await old.get(outside.https_url("/bytes/1"))).status_code == 200
        assert (await new.get(outside.https_url("/bytes/1", name="other.example.test"))).status_code == 200
        for client, name in ((old, "other.example.test"), (new, "files.example.test")):
            try:
                await client.get(outside.https_url("/bytes/1", name=name))
                raise AssertionError(f"{name} should have been refused")
            except httpx.ProxyError as exc:
                assert "403" in str(exc)
