"""The egress proxy's decisions one module at a time: names, allow-lists, addresses, ClientHellos, heads.

The ClientHellos are real ones, written by this interpreter's OpenSSL into a
memory BIO, and hand-built variants of them for what OpenSSL would never send.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandpool.core.settings import ConfigurationError, add_settings_arguments, settings_from_args
from sandpool.egress import allowlist
from sandpool.egress.addresses import AddressPolicy
from sandpool.egress.allowlist import BadEntry, outside_ceiling, parse, parse_entry
from sandpool.egress.hosts import BadHost, Destination, normalise_name, parse_authority, parse_host
from sandpool.egress.http import (
    Refusal,
    body_framing,
    client_response_head,
    origin_head,
    parse_absolute,
    parse_head,
)
from sandpool.egress.resolver import ResolveFailed, StaticResolver, parse_overrides
from sandpool.egress.settings import EgressSettings
from sandpool.egress.tls import NotClientHello, parse_client_hello, read_client_hello

# --- names -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "canonical"), [
    ("Example.COM", "example.com"),
    ("example.com.", "example.com"),
    ("files.example.org", "files.example.org"),
    ("_dmarc.example.org", "_dmarc.example.org"),
    ("bücher.example", "xn--bcher-kva.example"),
    ("BÜCHER.Example.", "xn--bcher-kva.example"),
    ("xn--bcher-kva.example", "xn--bcher-kva.example"),
])
def test_names_have_one_canonical_form(raw: str, canonical: str) -> None:
    assert normalise_name(raw) == canonical


@pytest.mark.parametrize("raw", ["", ".", "..", "example.com..", ".example.com", "a..b", "-a.example",
                                 "a-.example", "a b.example", "a%2e.example", "a/b.example", "exa\x00mple.com",
                                 "x" * 64 + ".example", ("a." * 127) + "com", "xn--zz-.example", "127.1",
                                 "0x7f.1", "2130706433", "1.2.3.4", "example.123", "example.0x1f"])
def test_malformed_and_numeric_names_are_refused(raw: str) -> None:
    with pytest.raises(BadHost):
        normalise_name(raw)


def test_authorities() -> None:
    assert parse_authority("Files.Example.org:443") == Destination(parse_host("files.example.org"), 443)
    v6 = parse_authority("[2001:DB8::1]:8443")
    assert v6.host.address == ipaddress.ip_address("2001:db8::1") and str(v6) == "[2001:db8::1]:8443"
    assert parse_authority("example.org", default_port=80).port == 80
    for bad in ("example.org", "example.org:", "example.org:0", "example.org:65536", "example.org:+80",
                "user@example.org:443", "[fe80::1%eth0]:443", "::1:443", "[::1]443", "[::1"):
        with pytest.raises(BadHost):
            parse_authority(bad)


# --- allow-lists -----------------------------------------------------------------------------------


def dest(text: str) -> Destination:
    return parse_authority(text)


@pytest.mark.parametrize(("entry", "admitted", "refused"), [
    ("files.example.org", ["files.example.org:443", "FILES.example.org.:443"],
     ["files.example.org:80", "x.files.example.org:443", "example.org:443", "files.example.org.evil.test:443"]),
    ("*.example.com", ["a.example.com:443", "a.b.example.com:443"],
     ["example.com:443", "badexample.com:443", "a.example.com:80", "a.example.com.evil.test:443"]),
    ("*.example.com:8443", ["a.example.com:8443"], ["a.example.com:443"]),
    ("*", ["anything.example:443"], ["anything.example:80", "203.0.113.7:443"]),
    ("203.0.113.7", ["203.0.113.7:443"], ["203.0.113.8:443", "203.0.113.7:80"]),
    ("[2001:db8::1]:80", ["[2001:db8:0::1]:80"], ["[2001:db8::2]:80"]),
    ("bücher.example", ["xn--bcher-kva.example:443"], ["bucher.example:443"]),
])
def test_allow_list_matching(entry: str, admitted: list[str], refused: list[str]) -> None:
    rules = parse([entry])
    for text in admitted:
        assert rules.admits(dest(text)), text
    for text in refused:
        assert not rules.admits(dest(text)), text


@pytest.mark.parametrize("entry", ["", " files.example.org", "*.*.example.org", "a*.example.org", "*example.org",
                                   "files.*.org", "*.", "example.org:", "example.org:http", "http://example.org",
                                   "example.org/path", "127.1", "[::1", "x" * 400])
def test_bad_entries_are_named(entry: str) -> None:
    with pytest.raises(BadEntry) as refused:
        parse_entry(entry)
    assert "egress allow-list entry" in str(refused.value)


def test_the_default_port_is_443_and_entries_print_as_written() -> None:
    assert [str(rule) for rule in parse(["a.example", "*.b.example:80", "*", "[::1]:8443", "10.0.0.1"]).rules] == [
        "a.example", "*.b.example:80", "*", "[::1]:8443", "10.0.0.1"]


def test_what_lies_outside_a_ceiling() -> None:
    ceiling = parse(["*.example.com", "pypi.org", "files.pythonhosted.org", "*:8443", "203.0.113.7"])
    inside = ["a.example.com", "*.a.example.com", "pypi.org", "anything.test:8443", "*.x.test:8443", "203.0.113.7"]
    assert outside_ceiling(inside, ceiling) == []
    outside = ["example.com", "*.example.com:80", "pypi.org:80", "*", "evil.test", "203.0.113.8", "*.com"]
    assert [line.split(" ")[0] for line in outside_ceiling(outside, ceiling)] == outside
    assert outside_ceiling(["*.example.com"], parse(["*.example.com"])) == []
    with pytest.raises(BadEntry):
        outside_ceiling(["bad entry"], ceiling)


def test_a_stored_list_that_cannot_be_read_admits_nothing() -> None:
    for raw in ("", "not json", '{"a": 1}', '"files.example.org"', "[1, 2]"):
        assert not allowlist.from_stored(raw)
    mixed = allowlist.from_stored('["files.example.org", "a b", 7, "*.example.com:80"]')
    assert [str(rule) for rule in mixed.rules] == ["files.example.org", "*.example.com:80"]


# --- addresses ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("address", "why"), [
    ("8.8.8.8", None), ("2001:4860:4860::8888", None), ("::ffff:8.8.8.8", None), ("64:ff9b::808:808", None),
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("2002:7f00:1::1", "loopback"), ("64:ff9b::7f00:1", "loopback"),
    ("169.254.169.254", "metadata"), ("::ffff:169.254.169.254", "metadata"), ("64:ff9b::a9fe:a9fe", "metadata"),
    ("fd00:ec2::254", "metadata"), ("100.100.100.200", "metadata"), ("169.254.170.2", "metadata"),
    ("192.0.0.192", "metadata"),
    ("169.254.1.1", "link_local"), ("fe80::1", "link_local"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("fc00::1", "private"),
    ("::ffff:10.0.0.1", "private"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("224.0.0.1", "multicast"), ("239.1.2.3", "multicast"), ("ff02::1", "multicast"),
    ("100.64.0.1", "not_global"),
])
def test_the_address_policy(address: str, why: str | None) -> None:
    assert AddressPolicy().refusal(ipaddress.ip_address(address)) == why


@pytest.mark.parametrize("address", ["240.0.0.1", "255.255.255.255", "192.0.2.1", "198.18.0.1", "2001:db8::1",
                                     "2001:0:4136:e378:8000:63bf:3fff:fdd2", "::ffff:0.0.0.0"])
def test_reserved_and_documentation_addresses_are_refused(address: str) -> None:
    assert AddressPolicy().refusal(ipaddress.ip_address(address)) is not None


def test_the_test_allowance_admits_loopback_and_nothing_more() -> None:
    policy = AddressPolicy(allow_loopback=True)
    for address in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        assert policy.refusal(ipaddress.ip_address(address)) is None
    for address in ("169.254.169.254", "10.0.0.1", "0.0.0.0", "fe80::1"):
        assert policy.refusal(ipaddress.ip_address(address)) is not None


def test_operator_ranges_are_refused_in_both_families() -> None:
    policy = AddressPolicy(denied=(ipaddress.ip_network("8.8.8.0/24"), ipaddress.ip_network("2001:4860::/32")))
    assert policy.refusal(ipaddress.ip_address("8.8.8.8")) == "denied_range"
    assert policy.refusal(ipaddress.ip_address("::ffff:8.8.8.8")) == "denied_range"
    assert policy.refusal(ipaddress.ip_address("2001:4860:4860::8888")) == "denied_range"
    assert policy.refusal(ipaddress.ip_address("8.8.4.4")) is None


def test_a_mapped_address_is_dialled_as_ipv4() -> None:
    policy = AddressPolicy()
    assert policy.connectable(ipaddress.ip_address("::ffff:8.8.8.8")) == ipaddress.ip_address("8.8.8.8")
    assert policy.connectable(ipaddress.ip_address("2001:db8::1")) == ipaddress.ip_address("2001:db8::1")


# --- the resolver -----------------------------------------------------------------------------------------


async def test_static_answers_come_first_and_unknown_names_fail_without_a_fallback() -> None:
    table = parse_overrides(["Files.Example.test=127.0.0.1", "files.example.test=::1", "x.test=[::2]"])
    assert table == {"files.example.test": [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")],
                     "x.test": [ipaddress.ip_address("::2")]}
    resolver = StaticResolver(table)
    assert await resolver.resolve("files.example.test") == table["files.example.test"]
    with pytest.raises(ResolveFailed):
        await resolver.resolve("other.example.test")
    for bad in ("no-equals", "bad name=1.2.3.4", "x.test=not-an-address"):
        with pytest.raises(ValueError):
            parse_overrides([bad])


# --- ClientHellos -----------------------------------------------------------------------------------------


def real_hello(server_name: str | None) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def read_hello(data: bytes, max_bytes: int = 16384) -> tuple[str | None, bool, bytes]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    hello = await read_client_hello(reader, max_bytes=max_bytes)
    return hello.server_name, hello.encrypted, hello.raw


def records(body: bytes, *sizes: int) -> bytes:
    """A handshake split over TLS records of the given sizes (the rest in a last record)."""
    out, pos = b"", 0
    for size in (*sizes, len(body)):
        part = body[pos: pos + size]
        if part:
            out += bytes([22, 3, 1]) + len(part).to_bytes(2, "big") + part
        pos += len(part)
    return out


def hello_with(extensions: list[tuple[int, bytes]]) -> bytes:
    """A minimal ClientHello record carrying `extensions` (type, data)."""
    ext = b"".join(kind.to_bytes(2, "big") + len(data).to_bytes(2, "big") + data for kind, data in extensions)
    body = (b"\x03\x03" + b"r" * 32 + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00"
            + len(ext).to_bytes(2, "big") + ext)
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return records(handshake)


def sni(*names: bytes, kind: int = 0) -> tuple[int, bytes]:
    entries = b"".join(bytes([kind]) + len(n).to_bytes(2, "big") + n for n in names)
    return 0, len(entries).to_bytes(2, "big") + entries


async def test_the_server_name_of_a_real_client_hello() -> None:
    data = real_hello("files.example.test")
    assert await read_hello(data) == ("files.example.test", False, data)
    assert (await read_hello(real_hello(None)))[0] is None
    assert (await read_hello(real_hello("127.0.0.1")))[0] is None  # no SNI for an address


async def test_a_client_hello_split_over_records_and_followed_by_nothing() -> None:
    data = real_hello("files.example.test")
    handshake = data[5:]
    split = records(handshake, 2, 100)
    name, _, raw = await read_hello(split)
    assert name == "files.example.test" and raw == split
    reader = asyncio.StreamReader()
    reader.feed_data(data + b"\x17\x03\x03\x00\x01X")  # what follows stays unread, for the relay
    reader.feed_eof()
    assert (await read_client_hello(reader, max_bytes=16384)).raw == data
    assert await reader.read() == b"\x17\x03\x03\x00\x01X"


@pytest.mark.parametrize(("extensions", "why"), [
    ([sni(b"a.test"), sni(b"b.test")], "sent twice"),
    ([sni(b"a.test", b"b.test")], "exactly one host name"),
    ([sni(b"")], "exactly one host name"),
    ([sni(b"a.test", kind=1)], "unknown server name type"),
    ([sni(b"caf\xc3\xa9.test")], "not ASCII"),
    ([(0, b"\x00\x0a\x00\x00\x06a.test")], "truncated"),
])
async def test_ambiguous_server_names_are_refused(extensions: list[tuple[int, bytes]], why: str) -> None:
    with pytest.raises(NotClientHello) as refused:
        await read_hello(hello_with(extensions))
    assert why in str(refused.value)


async def test_encrypted_client_hello_is_flagged() -> None:
    assert await read_hello(hello_with([sni(b"public.test"), (0xFE0D, b"\x00" * 8)])) == (
        "public.test", True, hello_with([sni(b"public.test"), (0xFE0D, b"\x00" * 8)]))


@pytest.mark.parametrize("data", [
    b"GET / HTTP/1.1\r\n\r\n",
    bytes([23, 3, 3, 0, 5]) + b"hello",  # application data first
    bytes([22, 3, 1, 0, 0]),  # empty record
    bytes([22, 3, 1, 0, 4, 2, 0, 0, 0]),  # a ServerHello
    bytes([22, 3, 1, 0x48, 0x01]) + b"\0" * 0x4801,  # record over 2^14 + slack
])
async def test_what_is_not_a_client_hello(data: bytes) -> None:
    with pytest.raises(NotClientHello):
        await read_hello(data, max_bytes=1 << 20)


async def test_a_client_hello_over_the_limit_is_refused_before_it_is_read() -> None:
    with pytest.raises(NotClientHello):
        await read_hello(real_hello("x" * 60 + ".example.test"), max_bytes=64)


async def test_a_truncated_client_hello_is_incomplete() -> None:
    data = real_hello("files.example.test")
    with pytest.raises(asyncio.IncompleteReadError):
        await read_hello(data[:-10])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_parse_or_are_refused_by_name(body: bytes) -> None:
    try:
        parse_client_hello(body)
    except NotClientHello:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_corruption_of_a_real_hello_parses_or_is_refused_by_name(data: st.DataObject) -> None:
    body = bytearray(REAL_BODY)
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    try:
        parse_client_hello(bytes(body))
    except NotClientHello:
        pass


REAL_BODY = real_hello("files.example.test")[9:]


# --- request heads -------------------------------------------------------------------------------------


def test_heads_are_parsed_strictly() -> None:
    head = parse_head(b"GET http://a.test/x?y HTTP/1.1\r\nHost: a.test\r\nX-Two: 1\r\nx-two: 2")
    assert (head.method, head.target, head.version) == ("GET", "http://a.test/x?y", "HTTP/1.1")
    assert head.values("X-TWO") == ["1", "2"]
    for bad in (b"GET http://a.test/ HTTP/2.0", b"GET  http://a.test/ HTTP/1.1", b"get http://a.test/ HTTP/1.1",
                b"GET http://a.test/ HTTP/1.1\r\n folded: yes", b"GET http://a.test/ HTTP/1.1\r\nNo Colon",
                b"GET http://a.test/ HTTP/1.1\r\nBad Name: x", b"GET http://a.test/ HTTP/1.1\r\nX: a\x01b",
                b"GET http://a.test/\x7f HTTP/1.1", "GET http://ä.test/ HTTP/1.1".encode()):
        with pytest.raises(Refusal):
            parse_head(bad)


def test_absolute_targets() -> None:
    parsed = parse_absolute("http://Files.Example.test:8080/a/b?c=d#frag")
    assert str(parsed.destination) == "files.example.test:8080" and parsed.origin_target == "/a/b?c=d"
    assert parse_absolute("http://a.test").origin_target == "/"
    assert parse_absolute("http://a.test?q").origin_target == "/?q"
    assert parse_absolute("HTTP://a.test/").destination.port == 80
    for target, status in (("https://a.test/", 405), ("ftp://a.test/", 405), ("/relative", 405),
                           ("http://user:pw@a.test/", 400), ("http://a..test/", 400), ("http://127.1/", 400)):
        with pytest.raises(Refusal) as refused:
            parse_absolute(target)
        assert refused.value.status == status, target


def test_body_framing_is_unambiguous() -> None:
    def framing(*headers: str) -> tuple[str, int]:
        found = body_framing(parse_head(("\r\n".join(["POST http://a.test/ HTTP/1.1", *headers])).encode()))
        return found.kind, found.length

    assert framing() == ("none", 0)
    assert framing("Content-Length: 12") == ("length", 12)
    assert framing("Content-Length: 12", "Content-Length: 12") == ("length", 12)
    assert framing("Transfer-Encoding: Chunked") == ("chunked", 0)
    for headers in (("Content-Length: 1", "Content-Length: 2"), ("Content-Length: -1",), ("Content-Length: 1e3",),
                    ("Transfer-Encoding: gzip, chunked",), ("Transfer-Encoding: chunked", "Content-Length: 3"),
                    ("Transfer-Encoding: chunked", "Transfer-Encoding: chunked")):
        with pytest.raises(Refusal):
            framing(*headers)


def test_the_origin_head_carries_no_hop_by_hop_header() -> None:
    head = parse_head(b"GET http://a.test:8080/p?q HTTP/1.1\r\nHost: evil.test\r\nProxy-Authorization: Basic eDp5\r\n"
                      b"Proxy-Connection: keep-alive\r\nConnection: keep-alive, X-Secret\r\nX-Secret: s\r\n"
                      b"Keep-Alive: 5\r\nUpgrade: websocket\r\nAccept: */*")
    sent = origin_head(head, parse_absolute(head.target)).decode()
    assert sent == ("GET /p?q HTTP/1.1\r\nHost: a.test:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n")


def test_the_client_is_told_the_connection_ends_with_the_response() -> None:
    status, head = client_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: keep-alive, X-Hop\r\n"
                                        b"X-Hop: 1\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\n\r\n")
    assert status == 200
    assert head == b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n"
    assert client_response_head(b"HTTP/1.1 100 Continue\r\n\r\n")[0] == 100
    assert client_response_head(b"HTTP/1.0 404\r\n\r\n") == (404, b"HTTP/1.0 404\r\nConnection: close\r\n\r\n")
    for bad in (b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/2 200\r\n\r\n", b"HTTP/1.1 99 Low\r\n\r\n"):
        with pytest.raises(ValueError):
            client_response_head(bad)


# --- settings ----------------------------------------------------------------------------------------------


def from_flags(*argv: str) -> EgressSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, EgressSettings)
    return settings_from_args(EgressSettings, parser.parse_args(list(argv)))


def test_the_loopback_allowance_needs_the_tests_mode() -> None:
    with pytest.raises(ConfigurationError) as refused:
        from_flags("--unsafe-allow-loopback-for-tests")
    assert "--unsafe-mode tests" in str(refused.value)
    with pytest.raises(ConfigurationError):
        from_flags("--unsafe-allow-loopback-for-tests", "--unsafe-mode", "yes")
    allowed = from_flags("--unsafe-allow-loopback-for-tests", "--unsafe-mode", "tests")
    assert allowed.address_policy().allow_loopback
    assert not from_flags().address_policy().allow_loopback


def test_bad_settings_are_named() -> None:
    for argv, named in ((["--egress-allow-ceiling", "*.*.x"], "--egress-allow-ceiling"),
                        (["--deny-cidrs", "10.0.0.0/33"], "--deny-cidrs"),
                        (["--resolve-overrides", "x.test"], "--resolve-overrides"),
                        (["--max-header-bytes", "10"], "--max-header-bytes")):
        with pytest.raises(ConfigurationError) as refused:
            from_flags(*argv)
        assert named in str(refused.value)


def test_lists_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDPOOL_EGRESS_ALLOW_CEILING", "pypi.org, files.pythonhosted.org")
    monkeypatch.setenv("SANDPOOL_DENY_CIDRS", "10.96.0.0/12,10.244.0.0/16")
    loaded = from_flags("--deny-cidrs", "192.0.2.0/24")
    assert str(loaded.ceiling()) == "pypi.org, files.pythonhosted.org"
    assert loaded.deny_cidrs == ["192.0.2.0/24"]  # the flag wins
    assert not from_flags().ceiling().admits(dest("evil.test:443"))
