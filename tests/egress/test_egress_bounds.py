"""The egress proxy's bounds: connections per sandbox and in all, head sizes, slow heads, idle tunnels.

No timing is asserted: a bound that fires is checked by what the client gets
(a status, or the connection closed), with generous deadlines.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from .conftest import MakeEgress, Outside, basic, connect_head, raw_request, read_answer


async def open_tunnel(port: int, authority: str, credential: str) -> tuple[int, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(connect_head(authority, credential).encode() + b"\r\n\r\n")
    await writer.drain()
    return (await read_answer(reader, read_body=False)).status, writer


async def test_a_sandbox_holds_at_most_its_share_of_connections(make_egress: MakeEgress, outside: Outside) -> None:
    egress = await make_egress(max_connections_per_credential=2)
    authority = f"files.example.test:{outside.https_tap.port}"
    greedy = await egress.bind_session([authority])
    other = await egress.bind_session([authority])
    held = [await open_tunnel(egress.port, authority, greedy.credential) for _ in range(2)]
    assert [status for status, _ in held] == [200, 200]
    over = await raw_request(egress.port, connect_head(authority, greedy.credential))
    assert over.status == 429 and over.headers["retry-after"] == "1"
    status, writer = await open_tunnel(egress.port, authority, other.credential)
    assert status == 200  # another sandbox is not affected
    writer.close()
    held[0][1].close()
    for _ in range(600):  # the freed slot comes back once the proxy has seen the close
        status, writer = await open_tunnel(egress.port, authority, greedy.credential)
        writer.close()
        if status == 200:
            break
        await asyncio.sleep(0.05)
    assert status == 200
    held[1][1].close()


async def test_a_workspace_holds_at_most_its_cap_of_connections_across_its_sandboxes(
        make_egress: MakeEgress, outside: Outside) -> None:
    """One tenant cannot take the whole proxy: its sandboxes together hold at most the workspace cap (the
    operator's ceiling when its policy sets none); another workspace is not affected."""
    egress = await make_egress(max_connections_per_workspace=3)
    authority = f"files.example.test:{outside.https_tap.port}"
    first, second = [await egress.bind_session([authority]) for _ in range(2)]
    other = await egress.bind_session([authority], workspace="ws-other")
    held = [await open_tunnel(egress.port, authority, bound.credential) for bound in (first, first, second)]
    assert [status for status, _ in held] == [200, 200, 200]
    over = await raw_request(egress.port, connect_head(authority, second.credential))
    assert over.status == 429 and over.headers["retry-after"] == "1"
    assert over.headers["x-sandpool-egress-refusal"] == "too_many_workspace_connections"
    assert "max_egress_connections" in over.phrase  # names the policy field that bounds it
    status, writer = await open_tunnel(egress.port, authority, other.credential)
    assert status == 200
    writer.close()
    for _, held_writer in held:
        held_writer.close()


async def test_the_workspace_policy_lowers_the_cap_and_never_raises_it(make_egress: MakeEgress,
                                                                       outside: Outside) -> None:
    """The cap the lease recorded on the session (the workspace policy's `max_egress_connections`) lowers
    the operator's ceiling; a value above the ceiling is bounded by it."""
    egress = await make_egress(max_connections_per_workspace=2)
    authority = f"files.example.test:{outside.https_tap.port}"
    low = await egress.bind_session([authority], workspace="ws-low", limits={"max_egress_connections": 1})
    high = await egress.bind_session([authority], workspace="ws-high", limits={"max_egress_connections": 50})
    held = [await open_tunnel(egress.port, authority, bound.credential) for bound in (low, high, high)]
    assert [status for status, _ in held] == [200, 200, 200]
    for bound in (low, high):
        over = await raw_request(egress.port, connect_head(authority, bound.credential))
        assert (over.status, over.headers["x-sandpool-egress-refusal"]) == (429, "too_many_workspace_connections")
    for _, writer in held:
        writer.close()


async def test_connections_in_all_are_bounded(make_egress: MakeEgress) -> None:
    egress = await make_egress(max_connections=2)
    idle = [await asyncio.open_connection("127.0.0.1", egress.port) for _ in range(2)]
    for _ in range(3000):
        if egress.proxy.active == 2:
            break
        await asyncio.sleep(0.01)
    assert egress.proxy.active == 2
    answer = await raw_request(egress.port, "GET /healthz HTTP/1.1\r\nHost: egress")
    assert answer.status == 503
    assert answer.headers["x-sandpool-egress-refusal"] == "too_many_connections"
    for _, writer in idle:
        writer.close()


async def test_a_request_head_over_the_limit_is_431(make_egress: MakeEgress, outside: Outside) -> None:
    egress = await make_egress(max_header_bytes=2048)
    bound = await egress.bind_session([f"files.example.test:{outside.http_tap.port}"])
    head = (f"GET {outside.http_url('/bytes/1')} HTTP/1.1\r\nProxy-Authorization: {basic(bound.credential)}\r\n"
            f"X-Padding: {'a' * 4000}")
    answer = await raw_request(egress.port, head)
    assert answer.status == 431
    many = "\r\n".join(f"X-{i}: 1" for i in range(150))
    answer = await raw_request(egress.port, f"GET {outside.http_url('/bytes/1')} HTTP/1.1\r\n{many}")
    assert answer.status == 431
    assert outside.http_tap.opened == 0


async def test_a_head_that_never_ends_is_408(make_egress: MakeEgress) -> None:
    egress = await make_egress(header_timeout_seconds=0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", egress.port)
    writer.write(b"CONNECT files.example.test:443 HTTP/1.1\r\n")
    await writer.drain()
    answer = await read_answer(reader)
    writer.close()
    assert answer.status == 408


async def test_a_tunnel_that_never_sends_its_client_hello_is_closed(make_egress: MakeEgress, outside: Outside) -> None:
    egress = await make_egress(header_timeout_seconds=0.2)
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    reader, writer = await asyncio.open_connection("127.0.0.1", egress.port)
    writer.write(connect_head(f"files.example.test:{outside.https_tap.port}", bound.credential).encode() + b"\r\n\r\n")
    await writer.drain()
    assert (await read_answer(reader, read_body=False)).status == 200
    assert await asyncio.wait_for(reader.read(), 30) == b""
    writer.close()


async def test_an_idle_tunnel_is_closed_and_still_metered(make_egress: MakeEgress, outside: Outside) -> None:
    egress = await make_egress(idle_timeout_seconds=1.0)
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    reader, writer = await asyncio.open_connection("127.0.0.1", egress.port)
    writer.write(connect_head(f"files.example.test:{outside.https_tap.port}", bound.credential).encode() + b"\r\n\r\n")
    await writer.drain()
    assert (await read_answer(reader, read_body=False)).status == 200
    await writer.start_tls(outside.certificate.client_context(), server_hostname="files.example.test")
    # then nothing: neither side sends a byte, and the proxy ends the tunnel (end of file, or a reset)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        while True:
            if not await asyncio.wait_for(reader.read(65536), 60):
                raise ConnectionError("closed")
    writer.close()
    for _ in range(600):
        usage = await egress.usage(bound.workspace)
        if usage.get("egress_connections") == "1" and outside.https_tap.flows:
            break
        await asyncio.sleep(0.05)
    sent, received = outside.https_tap.totals()
    assert int(usage["egress_bytes_out"]) == sent > 0  # the handshake's bytes
    # the origin may still answer the cut (its close_notify) into a socket the proxy has closed: not relayed
    assert 0 < int(usage["egress_bytes_in"]) <= received


async def test_a_client_hello_over_the_limit_is_refused(make_egress: MakeEgress, outside: Outside) -> None:
    egress = await make_egress(max_header_bytes=1024)
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    reader, writer = await asyncio.open_connection("127.0.0.1", egress.port)
    writer.write(connect_head(f"files.example.test:{outside.https_tap.port}", bound.credential).encode() + b"\r\n\r\n")
    await writer.drain()
    assert (await read_answer(reader, read_body=False)).status == 200
    # a handshake record announcing a 4000-byte ClientHello
    writer.write(bytes([22, 3, 1, 0x0F, 0xA4, 1, 0, 0x0F, 0xA0]) + b"\0" * 4000)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert data == b""  # not a ClientHello the proxy read: no alert (docs/egress.md, step 6)
    assert outside.https.seen == []


async def test_the_credential_never_reaches_the_logs(make_egress: MakeEgress, outside: Outside,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    egress = await make_egress()
    bound = await egress.bind_session([f"files.example.test:{outside.http_tap.port}"])
    for target in (outside.http_url("/bytes/3"), outside.http_url("/bytes/3", name="other.example.test")):
        await raw_request(egress.port, f"GET {target} HTTP/1.1\r\nProxy-Authorization: {basic(bound.credential)}")
    await raw_request(egress.port, connect_head("files.example.test:1", bound.credential + "x"))
    assert caplog.records
    for record in caplog.records:
        text = record.getMessage() + " " + str(record.__dict__)
        assert bound.credential not in text
        assert basic(bound.credential).split(" ")[1] not in text
