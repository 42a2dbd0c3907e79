"""Egress end to end: `sandpool up --egress-allow-ceiling`, tokens of workspaces with different allow-lists,
and what code in their leased sandboxes can and cannot reach.

The whole stack as a user runs it (Redis, the egress proxy, the controller with
isolated local sandboxes, the authenticating api); policies set through the
admin API; code sent through the api with each workspace's token. The outside
world is HTTPS and HTTP origins on the host's loopback behind counting taps, which
the egress proxy's resolver maps the test names to (`SANDPOOL_RESOLVE_OVERRIDES`,
and loopback admitted by the test-only setting, which reaches the egress proxy
through `up`'s environment; tests/isolation/test_isolation_egress.py refuses
loopback too). Usage is checked against the taps' byte counts.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import os
import shutil
import socket
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from egress.origins import TEST_NAMES, Certificate, Origin, Tap, make_certificate
from testkit import descendants, wait_for
from up_harness import Up, exec_code

from sandpool.edge.keys_cli import mint_token

pytestmark = pytest.mark.timeout(300)

OVERRIDES = [f"{name}=127.0.0.1" for name in TEST_NAMES] + [
    "metadata.example.test=169.254.169.254", "private.example.test=10.1.2.3",
    "mixed.example.test=127.0.0.1", "mixed.example.test=10.0.0.1"]


@dataclass
class Stack:
    up: Up
    url: str
    key: Path
    certificate: Certificate
    https: Origin
    https_tap: Tap
    http: Origin
    http_tap: Tap

    def token(self, workspace: str, *, admin: bool = False) -> str:
        return mint_token(self.key, workspace, admin=admin, ttl_seconds=3600)

    def client(self, workspace: str, *, admin: bool = False) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120,
                            headers={"Authorization": f"Bearer {self.token(workspace, admin=admin)}"})

    def allow(self, workspace: str, entries: list[str]) -> None:
        with self.client("ops", admin=True) as admin:
            put = admin.put(f"/v1/workspaces/{workspace}/policy", json={"egress_allow": entries})
            assert put.status_code == 200, put.text

    def https_url(self, path: str, name: str = "files.example.test") -> str:
        return f"https://{name}:{self.https_tap.port}{path}"

    def http_url(self, path: str, name: str = "files.example.test") -> str:
        return f"http://{name}:{self.http_tap.port}{path}"

    def tap_bytes(self) -> int:
        return sum(sum(tap.totals()) for tap in (self.https_tap, self.http_tap))

    def egress_bytes(self, workspace: str) -> int:
        with self.client("ops", admin=True) as admin:
            return int(admin.get("/v1/usage", params={"workspace": workspace}).json()["total"].get("egress_bytes", 0))

    def egress_socket(self) -> str:
        """The egress proxy's Unix socket, from its command line (`up` made it in a directory of its own)."""
        for pid in descendants(self.up.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"egress" in argv and b"--unix-socket" in argv:
                return argv[argv.index(b"--unix-socket") + 1].decode()
        raise AssertionError("no egress proxy among up's processes")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    certificate = make_certificate(tmp_path_factory.mktemp("egress-cert"))
    https, http = Origin(tls=certificate.server_context()), Origin()
    https_tap, http_tap = Tap(https.port), Tap(http.port)
    https.redirects["/to-metadata"] = "http://169.254.169.254/latest/meta-data/"
    https.redirects["/to-internal-name"] = f"https://metadata.example.test:{https_tap.port}/x"
    env = {"SANDPOOL_UNSAFE_ALLOW_LOOPBACK_FOR_TESTS": "true", "SANDPOOL_UNSAFE_MODE": "tests",
           "SANDPOOL_RESOLVE_OVERRIDES": ",".join(OVERRIDES)}
    up = Up("--egress-allow-ceiling", f"*:{https_tap.port},*:{http_tap.port}", "--pool-size", "1", env=env)
    try:
        url = up.printed("SANDPOOL_URL=", timeout=120)
        yield Stack(up, url, up.data_dir / "auth" / "dev-key.pem", certificate, https, https_tap, http, http_tap)
    finally:
        up.cleanup()
        for part in (https_tap, http_tap, https, http):
            part.close()


class Session:
    def __init__(self, stack: Stack, workspace: str) -> None:
        self.http = stack.client(workspace)
        created = self.http.post("/sessions", json={})
        assert created.status_code == 201, created.text
        self.id = created.json()["session_id"]
        self.run(f"open('ca.pem', 'w').write({stack.certificate.cert.read_text()!r})")

    def run(self, code: str) -> dict[str, Any]:
        result = exec_code(self.http, self.id, code)
        assert result["return_code"] == 0, result["stderr"]
        return result

    def json(self, code: str) -> Any:
        return json.loads(self.run(code)["stdout"])

    def bash(self, command: str) -> dict[str, Any]:
        response = self.http.post(f"/sessions/{self.id}/exec",
                                  json={"tool": "bash_code_execution", "input": {"command": command}})
        assert response.status_code == 200, response.text
        return response.json()["result_block"]["content"]

    def close(self) -> None:
        assert self.http.delete(f"/sessions/{self.id}").status_code == 204
        self.http.close()


FETCH = """
import json, ssl, urllib.request, urllib.error
context = ssl.create_default_context(cafile='ca.pem')
out = []
for url in URLS:
    try:
        with urllib.request.urlopen(url, context=context, timeout=20) as response:
            out.append({'status': response.status, 'length': len(response.read())})
    except urllib.error.HTTPError as exc:
        out.append({'status': exc.code, 'said': exc.reason})
    except (urllib.error.URLError, OSError) as exc:
        out.append({'error': str(getattr(exc, 'reason', exc))})
print(json.dumps(out))
"""


def fetch(session: Session, *urls: str) -> list[dict[str, Any]]:
    return session.json(FETCH.replace("URLS", repr(list(urls))))


SNI = """
import base64, json, os, socket, ssl
from urllib.parse import urlsplit
proxy = urlsplit(os.environ['https_proxy'])
s = socket.create_connection((proxy.hostname, proxy.port), timeout=20)
auth = base64.b64encode(f'{proxy.username}:{proxy.password}'.encode()).decode()
s.sendall(f'CONNECT files.example.test:PORT HTTP/1.1\\r\\nHost: files.example.test:PORT\\r\\n'
          f'Proxy-Authorization: Basic {auth}\\r\\n\\r\\n'.encode())
head = b''
while b'\\r\\n\\r\\n' not in head:
    head += s.recv(1)
out = {'connect': head.split(b' ')[1].decode()}
try:
    ssl.create_default_context(cafile='ca.pem').wrap_socket(s, server_hostname='other.example.test')
    out['tls'] = 'handshake completed'
except (ssl.SSLError, OSError) as exc:
    out['tls'] = str(exc)
print(json.dumps(out))
"""


def vendored_httpx() -> bytes:
    """httpx and what it imports, pure Python, as one zip a tenant could upload and import from."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in ("httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi", "typing_extensions"):
            module = importlib.import_module(name)
            path = Path(module.__file__ or "")
            if path.name == "__init__.py":
                for file in path.parent.rglob("*"):
                    if file.is_file() and "__pycache__" not in file.parts:
                        archive.write(file, str(file.relative_to(path.parent.parent)))
            else:
                archive.write(path, path.name)
    return buffer.getvalue()


HTTPX = """
import json, ssl, sys
sys.path.insert(0, 'httpx.zip')
import httpx
context = ssl.create_default_context(cafile='ca.pem')
out = []
with httpx.Client(verify=context, timeout=20) as client:  # the proxy from the environment
    for url in URLS:
        try:
            response = client.get(url)
            out.append({'status': response.status_code, 'length': len(response.content)})
        except httpx.HTTPError as exc:
            out.append({'error': f'{type(exc).__name__}: {exc}'})
print(json.dumps(out))
"""


def test_a_workspace_reaches_its_hosts_and_nothing_else_and_every_byte_is_metered(stack: Stack) -> None:
    https, http = stack.https_tap.port, stack.http_tap.port
    stack.allow("alpha", [f"files.example.test:{https}", f"files.example.test:{http}",
                          f"metadata.example.test:{https}", f"private.example.test:{https}",
                          f"mixed.example.test:{https}"])
    before_taps, before_usage = stack.tap_bytes(), stack.egress_bytes("alpha")
    seen_before = len(stack.https.seen)
    session = Session(stack, "alpha")
    try:
        # urllib, from the environment's proxy, HTTPS and plain HTTP
        ok, plain = fetch(session, stack.https_url("/bytes/4321"), stack.http_url("/bytes/99"))
        assert ok == {"status": 200, "length": 4321} and plain == {"status": 200, "length": 99}

        # httpx, brought by the tenant
        upload = session.http.post(f"/sessions/{session.id}/files",
                                   files={"file": ("httpx.zip", vendored_httpx(), "application/zip")})
        assert upload.status_code == 201, upload.text
        secure, refused = session.json(HTTPX.replace("URLS", repr([
            stack.https_url("/bytes/777"), stack.https_url("/bytes/1", "other.example.test")])))
        assert secure == {"status": 200, "length": 777}
        assert "403" in refused["error"], refused

        # curl, which reads the lower-case variable
        if shutil.which("curl"):
            done = session.bash(f"curl -sS --cacert ca.pem -o /dev/null -w '%{{http_code}} %{{size_download}}' "
                                f"{stack.https_url('/bytes/1234')}")
            assert done["stdout"] == "200 1234", done
            said = session.bash(f"curl -sS -v --cacert ca.pem {stack.https_url('/bytes/1', 'other.example.test')}")
            assert said["return_code"] != 0
            assert "403 sandpool egress: other.example.test" in said["stderr"] and "egress_allow" in said["stderr"]

        # refusals: another host, an address literal, names leading to internal addresses, redirects inward
        other, literal, loopback, metadata, private, mixed, to_metadata, to_internal = fetch(
            session, stack.https_url("/", "other.example.test"), stack.https_url("/", "10.1.2.3"),
            stack.https_url("/", "127.0.0.1"),
            stack.https_url("/", "metadata.example.test"), stack.https_url("/", "private.example.test"),
            stack.https_url("/", "mixed.example.test"), stack.https_url("/to-metadata"),
            stack.https_url("/to-internal-name"))
        assert "403" in other["error"] and "not on this workspace's egress allow-list" in other["error"]
        assert "egress_allow" in other["error"]
        assert "403" in literal["error"] and "10.1.2.3" in literal["error"]
        assert "Connection refused" in loopback["error"]  # no_proxy: the sandbox's own loopback, not the host's
        for refused_address in (metadata, private, mixed):
            assert "403" in refused_address["error"] and "address" in refused_address["error"], refused_address
        assert to_metadata["status"] == 403  # the redirect is a new request through the proxy: refused
        assert "403" in to_internal["error"] and "address" in to_internal["error"]

        # Metered exactly: what crossed the taps is what the workspace's usage says (refusals cost nothing).
        def counts() -> tuple[int, int]:
            return stack.tap_bytes() - before_taps, stack.egress_bytes("alpha") - before_usage

        def metered_exactly() -> bool:
            crossed, metered = counts()
            return crossed == metered and crossed > 4321 + 777 + 99

        wait_for(metered_exactly, timeout=30, interval=0.2, what="the usage to match the taps",
                 state=lambda: "the taps counted {}, usage says {}".format(*counts()))

        # SNI naming another host than the checked CONNECT: the tunnel is cut before the origin hears anything
        handshake = session.json(SNI.replace("PORT", str(https)))
        assert handshake["connect"] == "200" and "ACCESS_DENIED" in handshake["tls"].upper(), handshake
    finally:
        session.close()
    # The origin heard only the allowed requests (and the two redirects it answered itself).
    expected = ["/bytes/4321", "/bytes/777", "/to-metadata", "/to-internal-name"]
    expected += ["/bytes/1234"] if shutil.which("curl") else []
    assert sorted(seen.path for seen in stack.https.seen[seen_before:]) == sorted(expected)


def test_two_workspaces_get_their_own_lists(stack: Stack) -> None:
    port = stack.https_tap.port
    stack.allow("beta", [f"other.example.test:{port}"])
    stack.allow("gamma", [])
    beta, gamma = Session(stack, "beta"), Session(stack, "gamma")
    try:
        allowed, refused = fetch(beta, stack.https_url("/bytes/5", "other.example.test"), stack.https_url("/bytes/5"))
        assert allowed == {"status": 200, "length": 5}
        assert "403" in refused["error"] and "files.example.test" in refused["error"]
        [nothing] = fetch(gamma, stack.https_url("/bytes/5", "other.example.test"))
        assert "403" in nothing["error"] and "egress_allow" in nothing["error"]
    finally:
        beta.close()
        gamma.close()


def test_a_policy_change_applies_to_new_sessions(stack: Stack) -> None:
    port = stack.https_tap.port
    stack.allow("delta", [f"files.example.test:{port}"])
    first = Session(stack, "delta")
    try:
        stack.allow("delta", [f"other.example.test:{port}"])
        second = Session(stack, "delta")
        try:
            old_files, old_other = fetch(first, stack.https_url("/bytes/3"),
                                         stack.https_url("/bytes/3", "other.example.test"))
            new_files, new_other = fetch(second, stack.https_url("/bytes/3"),
                                         stack.https_url("/bytes/3", "other.example.test"))
        finally:
            second.close()
    finally:
        first.close()
    assert old_files["status"] == 200 and "403" in old_other["error"]  # leased before: keeps its list
    assert "403" in new_files["error"] and new_other["status"] == 200


def test_a_released_sessions_credential_stops_working_at_once(stack: Stack) -> None:
    port = stack.https_tap.port
    stack.allow("epsilon", [f"files.example.test:{port}"])
    session = Session(stack, "epsilon")
    proxy_url = session.run("import os; print(os.environ['https_proxy'])")["stdout"].strip()
    credential = proxy_url.split("://", 1)[1].rsplit("@", 1)[0].split(":", 1)[1]
    egress = stack.egress_socket()

    def connect() -> bytes:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(20)
            s.connect(egress)
            auth = base64.b64encode(f"sandbox:{credential}".encode()).decode()
            s.sendall(f"CONNECT files.example.test:{port} HTTP/1.1\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
                      .encode())
            return s.recv(200)

    assert connect().startswith(b"HTTP/1.1 200")
    session.close()
    refused = connect()
    assert refused.startswith(b"HTTP/1.1 407"), refused
    assert os.path.exists(egress)
