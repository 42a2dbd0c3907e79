"""What the egress proxy refuses, and that a refusal reaches nothing outside.

Every refusal is checked on the wire (status, reason header, message) and at
the stand-in for the outside: the tap in front of the origin must not even have
been connected to (or, for a refused tunnel, must have received no byte).
"""

from __future__ import annotations

import asyncio
import base64
import ssl

import httpx
import pytest

from sandpool.state.keys import egress_digest

from .conftest import Egress, MakeEgress, Outside, basic, connect_head, raw_request, read_answer
from .origins import Flow


async def tunnel(egress: Egress, authority: str, credential: str) -> tuple[asyncio.StreamReader,
                                                                             asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", egress.port)
    writer.write(connect_head(authority, credential).encode() + b"\r\n\r\n")
    await writer.drain()
    answer = await read_answer(reader, read_body=False)
    assert answer.status == 200, answer
    return reader, writer


async def finished_flows(outside: Outside, count: int) -> list[Flow]:
    for _ in range(600):
        with outside.https_tap.lock:
            if len(outside.https_tap.flows) >= count:
                return list(outside.https_tap.flows)
        await asyncio.sleep(0.05)
    raise AssertionError(f"the tap did not see {count} finished connections")


# --- credentials -----------------------------------------------------------------------------

@pytest.mark.parametrize("authorization", [
    None,
    "Bearer abcdefghijklmnopqrstuvwxyz",
    "Basic !!!not-base64!!!",
    "Basic " + base64.b64encode(b"sandbox:short").decode(),
    "Basic " + base64.b64encode(b"no-colon-at-all-just-a-user").decode(),
])
async def test_a_missing_or_malformed_credential_is_407(egress: Egress, outside: Outside,
                                                         authorization: str | None) -> None:
    head = f"CONNECT files.example.test:{outside.https_tap.port} HTTP/1.1"
    if authorization is not None:
        head += f"\r\nProxy-Authorization: {authorization}"
    answer = await raw_request(egress.port, head)
    assert answer.status == 407
    assert answer.headers["proxy-authenticate"].startswith("Basic")
    assert answer.headers["x-sandpool-egress-refusal"] in ("no_credential", "bad_credential")
    assert outside.https_tap.opened == 0


async def test_an_unknown_credential_is_407(egress: Egress, outside: Outside) -> None:
    """A warm sandbox's credential is unknown to Redis until a lease binds it: it admits nothing."""
    answer = await raw_request(egress.port, connect_head(f"files.example.test:{outside.https_tap.port}",
                                                         "never-bound-credential-0123456789"))
    assert answer.status == 407
    assert answer.headers["x-sandpool-egress-refusal"] == "unknown_credential"
    assert b"unknown, revoked, or its session has ended" in answer.body


async def test_a_revoked_credential_stops_working_at_once(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    authority = f"files.example.test:{outside.https_tap.port}"
    first = await raw_request(egress.port, connect_head(authority, bound.credential), read_body=False)
    assert first.status == 200
    assert await egress.store.unbind(bound.credential)
    again = await raw_request(egress.port, connect_head(authority, bound.credential))
    assert again.status == 407


async def test_the_release_unbinds_the_credential_in_its_own_step(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    key = egress.keys.egress_binding(bound.credential)
    assert await egress.store.redis.exists(key)
    await egress.release(bound)
    assert not await egress.store.redis.exists(key)
    answer = await raw_request(egress.port, connect_head(f"files.example.test:{outside.https_tap.port}",
                                                         bound.credential))
    assert answer.status == 407 and answer.headers["x-sandpool-egress-refusal"] == "unknown_credential"
    assert outside.https_tap.opened == 0


async def test_a_released_sessions_credential_is_refused_and_its_binding_dropped(
        egress: Egress, outside: Outside) -> None:
    """Even if a binding outlived its session (written again behind the release's back), the session is
    gone, so is the credential."""
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    await egress.release(bound)
    await egress.store.bind(bound.credential, session=bound.session, workspace=bound.workspace,
                            allow=[f"files.example.test:{outside.https_tap.port}"], ttl_seconds=60)
    key = egress.keys.egress_binding(bound.credential)
    assert await egress.store.redis.exists(key)
    answer = await raw_request(egress.port, connect_head(f"files.example.test:{outside.https_tap.port}",
                                                         bound.credential))
    assert answer.status == 407
    assert not await egress.store.redis.exists(key)
    assert outside.https_tap.opened == 0


async def test_a_binding_naming_another_workspace_than_its_session_is_refused(
        egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    await egress.store.redis.hset(egress.keys.egress_binding(bound.credential), "workspace", "someone-else")
    answer = await raw_request(egress.port, connect_head(f"files.example.test:{outside.https_tap.port}",
                                                         bound.credential))
    assert answer.status == 407


async def test_redis_never_holds_the_credential_itself(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    keys = [key async for key in egress.store.redis.scan_iter(match=egress.keys.base + "*")]
    assert egress.keys.egress_binding(bound.credential).endswith(egress_digest(bound.credential))
    for key in keys:
        assert bound.credential not in key
        if await egress.store.redis.type(key) == "hash":
            assert bound.credential not in str(await egress.store.redis.hgetall(key))


# --- the allow-list and the ceiling -------------------------------------------------------------

async def test_a_host_off_the_allow_list_is_403_naming_host_and_policy(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    authority = f"other.example.test:{outside.https_tap.port}"
    answer = await raw_request(egress.port, connect_head(authority, bound.credential))
    assert answer.status == 403
    assert answer.headers["x-sandpool-egress-refusal"] == "not_allowed"
    assert authority in answer.phrase and "egress_allow" in answer.phrase
    assert authority.encode() in answer.body and b"egress_allow" in answer.body
    assert outside.https_tap.opened == 0


async def test_the_port_counts(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session(["files.example.test"])  # port 443 only
    answer = await raw_request(egress.port, connect_head(f"files.example.test:{outside.https_tap.port}",
                                                         bound.credential))
    assert answer.status == 403 and answer.headers["x-sandpool-egress-refusal"] == "not_allowed"


async def test_an_empty_allow_list_admits_nothing(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([])
    answer = await raw_request(egress.port, connect_head(f"files.example.test:{outside.https_tap.port}",
                                                         bound.credential))
    assert answer.status == 403


async def test_the_ceiling_bounds_the_session_list(make_egress: MakeEgress, outside: Outside) -> None:
    egress = await make_egress(ceiling=[f"other.example.test:{outside.https_tap.port}"])
    bound = await egress.bind_session([f"*.example.test:{outside.https_tap.port}"])
    answer = await raw_request(egress.port, connect_head(f"files.example.test:{outside.https_tap.port}",
                                                         bound.credential))
    assert answer.status == 403
    assert answer.headers["x-sandpool-egress-refusal"] == "above_ceiling"
    assert "egress_allow_ceiling" in answer.phrase
    allowed = await raw_request(egress.port, connect_head(f"other.example.test:{outside.https_tap.port}",
                                                          bound.credential), read_body=False)
    assert allowed.status == 200


async def test_an_empty_ceiling_means_no_egress(make_egress: MakeEgress, outside: Outside) -> None:
    egress = await make_egress(ceiling=[])
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    answer = await raw_request(egress.port, connect_head(f"files.example.test:{outside.https_tap.port}",
                                                         bound.credential))
    assert answer.status == 403 and answer.headers["x-sandpool-egress-refusal"] == "above_ceiling"


@pytest.mark.parametrize("host", ["FILES.Example.TEST", "files.example.test."])
async def test_case_and_the_absolute_dot_name_the_same_host(egress: Egress, outside: Outside, host: str) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    reader, writer = await tunnel(egress, f"{host}:{outside.https_tap.port}", bound.credential)
    try:
        await writer.start_tls(outside.certificate.client_context(), server_hostname="files.example.test")
        writer.write(b"GET /bytes/3 HTTP/1.1\r\nHost: files.example.test\r\nConnection: close\r\n\r\n")
        await writer.drain()
        assert (await asyncio.wait_for(reader.read(), 30)).endswith(b"\r\n\r\nxxx")
    finally:
        writer.close()


async def test_a_wildcard_admits_names_below_it_only(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"*.cdn.example.test:{outside.https_tap.port}"])
    below = await raw_request(egress.port, connect_head(f"deep.cdn.example.test:{outside.https_tap.port}",
                                                        bound.credential), read_body=False)
    assert below.status == 200
    for host in ("cdn.example.test", "evilcdn.example.test", "deep.cdn.example.test.evil.test"):
        answer = await raw_request(egress.port, connect_head(f"{host}:{outside.https_tap.port}", bound.credential))
        assert answer.status == 403, host


@pytest.mark.parametrize("authority", ["2130706433:443", "127.1:443", "0x7f.0.0.1:443", "files..example.test:443",
                                       "files.example.test..:443", "files.example.test", "user@files.example.test:443",
                                       "[::1:443", "files.example.test:99999", "*.example.test:443"])
async def test_malformed_and_numeric_authorities_are_400(egress: Egress, authority: str) -> None:
    bound = await egress.bind_session(["*:443"])
    answer = await raw_request(egress.port, connect_head(authority, bound.credential))
    assert answer.status == 400
    assert answer.headers["x-sandpool-egress-refusal"] == "bad_destination"


# --- addresses --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "why"), [
    ("loopback.example.test", "loopback"),
    ("loopback6.example.test", "loopback"),
    ("files.example.test", "loopback"),
    ("mapped.example.test", "loopback"),
])
async def test_a_name_resolving_to_loopback_is_refused_without_the_test_allowance(
        make_egress: MakeEgress, outside: Outside, name: str, why: str) -> None:
    egress = await make_egress(loopback=False)
    bound = await egress.bind_session([f"{name}:{outside.https_tap.port}"])
    answer = await raw_request(egress.port, connect_head(f"{name}:{outside.https_tap.port}", bound.credential))
    assert answer.status == 403
    assert answer.headers["x-sandpool-egress-refusal"] == "address_refused"
    assert f"refused address ({why})" in answer.phrase
    assert "127.0.0.1" not in answer.body.decode()  # the internal address is not told
    assert outside.https_tap.opened == 0


@pytest.mark.parametrize(("name", "why"), [
    ("metadata.example.test", "metadata"),
    ("mapped-metadata.example.test", "metadata"),
    ("cgnat.example.test", "metadata"),
    ("private.example.test", "private"),
    ("mixed.example.test", "private"),
    ("denied.example.test", "denied range"),
])
async def test_internal_addresses_are_refused_even_with_the_test_allowance(
        make_egress: MakeEgress, name: str, why: str) -> None:
    egress = await make_egress(ceiling=["*"], deny_cidrs=["8.8.8.0/24"])
    bound = await egress.bind_session([name])
    answer = await raw_request(egress.port, connect_head(f"{name}:443", bound.credential))
    assert answer.status == 403
    assert answer.headers["x-sandpool-egress-refusal"] == "address_refused"
    assert f"({why})" in answer.phrase


async def test_an_address_literal_needs_a_list_that_names_it(egress: Egress, outside: Outside) -> None:
    port = outside.https_tap.port
    by_name = await egress.bind_session([f"*:{port}", f"files.example.test:{port}"])
    refused = await raw_request(egress.port, connect_head(f"127.0.0.1:{port}", by_name.credential))
    assert refused.status == 403 and refused.headers["x-sandpool-egress-refusal"] == "not_allowed"

    literal = await egress.bind_session([f"127.0.0.1:{port}"])
    async with httpx.AsyncClient(proxy=egress.url(literal.credential), verify=outside.certificate.client_context(),
                                 trust_env=False) as client:
        response = await client.get(f"https://127.0.0.1:{port}/bytes/7")
    assert response.status_code == 200 and response.content == b"x" * 7


async def test_a_listed_literal_is_still_subject_to_the_address_policy(
        make_egress: MakeEgress, outside: Outside) -> None:
    port = outside.https_tap.port
    egress = await make_egress(loopback=False, ceiling=[f"127.0.0.1:{port}", "169.254.169.254:443", "[::1]:443",
                                                        "[::ffff:127.0.0.1]:443"])
    bound = await egress.bind_session([f"127.0.0.1:{port}", "169.254.169.254:443", "[::1]:443",
                                       "[::ffff:127.0.0.1]:443"])
    for authority, why in ((f"127.0.0.1:{port}", "loopback"), ("169.254.169.254:443", "metadata"),
                           ("[::1]:443", "loopback"), ("[::ffff:127.0.0.1]:443", "loopback")):
        answer = await raw_request(egress.port, connect_head(authority, bound.credential))
        assert answer.status == 403, authority
        assert f"({why})" in answer.phrase, authority
    assert outside.https_tap.opened == 0


# --- SNI ------------------------------------------------------------------------------------------------

async def test_a_tunnel_whose_sni_names_another_host_is_cut_before_a_byte_goes_out(
        egress: Egress, outside: Outside) -> None:
    """The certificate covers both names, so only the proxy's check stands in the way."""
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    reader, writer = await tunnel(egress, f"files.example.test:{outside.https_tap.port}", bound.credential)
    with pytest.raises((ssl.SSLError, ConnectionError)) as refused:
        await writer.start_tls(outside.certificate.client_context(), server_hostname="other.example.test")
    writer.close()
    assert "ACCESS_DENIED" in str(refused.value).upper()
    [flow] = await finished_flows(outside, 1)
    assert flow.from_proxy == 0  # not a byte of the client's reached the origin
    assert outside.https.seen == []


async def test_a_tunnel_without_sni_is_refused(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    reader, writer = await tunnel(egress, f"files.example.test:{outside.https_tap.port}", bound.credential)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await writer.start_tls(context, server_hostname=None)
    writer.close()
    [flow] = await finished_flows(outside, 1)
    assert flow.from_proxy == 0


async def test_a_tunnel_that_does_not_speak_tls_is_cut(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.http_tap.port}"])
    reader, writer = await tunnel(egress, f"files.example.test:{outside.http_tap.port}", bound.credential)
    writer.write(b"GET /bytes/10 HTTP/1.1\r\nHost: files.example.test\r\n\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 30) == b""
    writer.close()
    assert outside.http.seen == []


async def test_a_literal_tunnel_must_not_carry_a_server_name(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"127.0.0.1:{outside.https_tap.port}"])
    reader, writer = await tunnel(egress, f"127.0.0.1:{outside.https_tap.port}", bound.credential)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await writer.start_tls(outside.certificate.client_context(), server_hostname="files.example.test")
    writer.close()
    assert outside.https.seen == []


# --- what is not a proxy request ------------------------------------------------------------------------

async def test_healthz_is_answered_locally_without_a_credential(egress: Egress) -> None:
    answer = await raw_request(egress.port, "GET /healthz HTTP/1.1\r\nHost: egress")
    assert answer.status == 200 and answer.body.startswith(b"ok")
    ready = await raw_request(egress.port, "GET /readyz HTTP/1.1\r\nHost: egress")
    assert ready.status == 200


@pytest.mark.parametrize("head", [
    "GET / HTTP/1.1\r\nHost: egress",
    "GET /metrics HTTP/1.1\r\nHost: egress",
    "POST /healthz HTTP/1.1\r\nHost: egress\r\nContent-Length: 0",
])
async def test_other_origin_form_requests_are_405(egress: Egress, head: str) -> None:
    answer = await raw_request(egress.port, head)
    assert answer.status == 405


@pytest.mark.parametrize("target", ["https://files.example.test/", "ftp://files.example.test/x"])
async def test_absolute_urls_of_other_schemes_are_405(egress: Egress, outside: Outside, target: str) -> None:
    bound = await egress.bind_session(["*:443", "*:21"])
    answer = await raw_request(egress.port, f"GET {target} HTTP/1.1\r\nProxy-Authorization: {basic(bound.credential)}")
    assert answer.status == 405 and answer.headers["x-sandpool-egress-refusal"] == "scheme_refused"


async def test_ambiguous_body_framing_is_refused(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.http_tap.port}"])
    head = (f"POST {outside.http_url('/echo')} HTTP/1.1\r\nProxy-Authorization: {basic(bound.credential)}\r\n"
            "Content-Length: 5\r\nTransfer-Encoding: chunked")
    answer = await raw_request(egress.port, head, b"0\r\n\r\n")
    assert answer.status == 400
    assert outside.http_tap.opened == 0


async def test_the_credential_is_checked_before_the_body_framing(egress: Egress, outside: Outside) -> None:
    """The order docs/egress.md gives: a request both without a credential and framed ambiguously is refused
    for its credential; the framing is checked only for a caller with a valid one."""
    head = f"POST {outside.http_url('/echo')} HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked"
    answer = await raw_request(egress.port, head, b"0\r\n\r\n")
    assert (answer.status, answer.headers["x-sandpool-egress-refusal"]) == (407, "no_credential")
    assert outside.http_tap.opened == 0


async def test_a_second_request_on_a_plain_connection_goes_nowhere(egress: Egress, outside: Outside) -> None:
    """One request per connection: what follows the first request's body is never sent on."""
    bound = await egress.bind_session([f"files.example.test:{outside.http_tap.port}"])
    auth = f"Proxy-Authorization: {basic(bound.credential)}"
    first = f"POST {outside.http_url('/echo')} HTTP/1.1\r\n{auth}\r\nContent-Length: 5\r\n\r\nhello"
    other = outside.http_url("/bytes/1", name="other.example.test")
    second = f"GET {other} HTTP/1.1\r\nHost: other.example.test\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", egress.port)
    writer.write((first + second).encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert data.count(b"HTTP/1.") == 1 and b'"received": 5' in data
    assert [(seen.method, seen.path) for seen in outside.http.seen] == [("POST", "/echo")]


async def test_an_origin_that_does_not_answer_http_is_502(egress: Egress, outside: Outside) -> None:
    """Plain HTTP sent to a TLS server: it never answers in HTTP, and the client is told so."""
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    target = f"http://files.example.test:{outside.https_tap.port}/bytes/1"
    answer = await raw_request(egress.port, f"GET {target} HTTP/1.1\r\nProxy-Authorization: {basic(bound.credential)}")
    assert answer.status == 502 and answer.headers["x-sandpool-egress-refusal"] == "bad_response"
