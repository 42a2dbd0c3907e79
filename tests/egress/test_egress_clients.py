"""Real clients through the egress proxy: curl, httpx, urllib and pip, as sandboxed code would use it.

Each client gets only the proxy URL with the sandbox's credential in it
(`HTTPS_PROXY=http://sandbox:<credential>@host:port`, or its own flag) and the
test origin's certificate; the proxy maps the test names to loopback origins.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from .conftest import Egress, Outside, clean_env
from .origins import wheel

CURL = shutil.which("curl")
needs_curl = pytest.mark.skipif(CURL is None, reason="curl is not installed")


async def run(argv: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=timeout)


@needs_curl
async def test_curl_reaches_an_allowed_https_host(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    done = await run([CURL, "-sS", "--fail", "--cacert", str(outside.certificate.cert), "--proxy",
                      egress.url(bound.credential), outside.https_url("/bytes/1234")], clean_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout == "x" * 1234
    assert [seen.path for seen in outside.https.seen] == ["/bytes/1234"]
    # the origin saw no proxy credential: it never leaves the proxy
    assert not any("proxy-authorization" in seen.headers for seen in outside.https.seen)


@needs_curl
async def test_curl_is_told_why_a_host_is_refused(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    done = await run([CURL, "-sS", "-v", "--cacert", str(outside.certificate.cert), "--proxy",
                      egress.url(bound.credential), outside.https_url("/bytes/1", name="other.example.test")],
                     clean_env())
    assert done.returncode != 0
    assert "403" in done.stderr
    assert "other.example.test" in done.stderr and "egress_allow" in done.stderr
    assert outside.https_tap.opened == 0


@needs_curl
async def test_curl_plain_http_through_the_proxy(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.http_tap.port}"])
    done = await run([CURL, "-sS", "--fail", "--proxy", egress.url(bound.credential),
                      "--data-binary", "hello origin", outside.http_url("/echo")], clean_env())
    assert done.returncode == 0, done.stderr
    assert '"received": 12' in done.stdout
    [seen] = outside.http.seen
    assert seen.path == "/echo"  # origin form, not the absolute URL
    assert seen.headers["host"] == f"files.example.test:{outside.http_tap.port}"
    assert "proxy-authorization" not in seen.headers and "proxy-connection" not in seen.headers
    assert seen.headers["connection"] == "close"


async def chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_httpx_reaches_an_allowed_host_over_https_and_http(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}",
                                       f"files.example.test:{outside.http_tap.port}"])
    async with httpx.AsyncClient(proxy=egress.url(bound.credential), verify=outside.certificate.client_context(),
                                 trust_env=False) as client:
        secure = await client.get(outside.https_url("/bytes/5000"))
        plain = await client.post(outside.http_url("/echo"), content=b"z" * 70_000)
        chunked = await client.post(outside.http_url("/echo"), content=chunks([b"a" * 10, b"b" * 20_000]))
    assert secure.status_code == 200 and secure.content == b"x" * 5000
    assert plain.status_code == 200 and plain.json()["received"] == 70_000
    assert chunked.status_code == 200 and chunked.json()["received"] == 20_010


async def test_httpx_sees_a_refusal_as_a_proxy_error(egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    async with httpx.AsyncClient(proxy=egress.url(bound.credential), verify=outside.certificate.client_context(),
                                 trust_env=False) as client:
        with pytest.raises(httpx.ProxyError) as refused:
            await client.get(outside.https_url("/bytes/1", name="other.example.test"))
    assert "403" in str(refused.value)


URLLIB = """
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=30) as response:
        sys.stdout.write(response.read().decode())
except (urllib.error.URLError, OSError) as exc:
    sys.stdout.write("refused: " + str(exc))
    sys.exit(3)
"""


async def test_python_urllib_uses_https_proxy_from_the_environment(egress: Egress, outside: Outside) -> None:
    """What sandboxed code gets: HTTPS_PROXY and HTTP_PROXY set, nothing else changed."""
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    env = clean_env(HTTPS_PROXY=egress.url(bound.credential), HTTP_PROXY=egress.url(bound.credential),
                    SSL_CERT_FILE=str(outside.certificate.cert))
    allowed = await run([sys.executable, "-c", URLLIB, outside.https_url("/bytes/321")], env)
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout == "x" * 321
    refused = await run([sys.executable, "-c", URLLIB, outside.https_url("/bytes/1", name="other.example.test")], env)
    assert refused.returncode == 3
    assert "403" in refused.stdout and "egress_allow" in refused.stdout


def package_index(outside: Outside) -> str:
    """Serve a one-package simple index on the HTTPS origin; its URL as pip sees it."""
    name, data = wheel("egresstest_pkg", "0.1")
    outside.https.files[f"/files/{name}"] = ("application/octet-stream", data)
    outside.https.files["/simple/egresstest-pkg/"] = (
        "text/html", f'<html><body><a href="/files/{name}">{name}</a></body></html>'.encode())
    return outside.https_url("/simple/", name="pypi.example.test")


async def test_pip_downloads_from_an_allowed_index_and_fails_at_once_on_a_refused_one(
        egress: Egress, outside: Outside, tmp_path: Path) -> None:
    index = package_index(outside)
    allowed = await egress.bind_session([f"pypi.example.test:{outside.https_tap.port}"])
    refused = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])

    def pip(credential: str, dest: Path) -> list[str]:
        return [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--no-cache-dir",
                "--retries", "1", "--timeout", "20", "--index-url", index, "--dest", str(dest), "egresstest-pkg"]

    base = clean_env(SSL_CERT_FILE=str(outside.certificate.cert), PIP_CERT=str(outside.certificate.cert),
                     PIP_CONFIG_FILE="/dev/null")
    ok = await run(pip(allowed.credential, tmp_path / "ok"), {**base, "HTTPS_PROXY": egress.url(allowed.credential)},
                   timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert [p.name for p in (tmp_path / "ok").iterdir()] == ["egresstest_pkg-0.1-py3-none-any.whl"]

    no = await run(pip(refused.credential, tmp_path / "no"), {**base, "HTTPS_PROXY": egress.url(refused.credential)},
                   timeout=120)
    assert no.returncode != 0
    said = no.stdout + no.stderr
    assert "pypi.example.test" in said and "egress_allow" in said, said
    assert not (tmp_path / "no").exists() or not any((tmp_path / "no").iterdir())
