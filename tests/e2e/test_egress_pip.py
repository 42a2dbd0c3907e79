"""`pip install` in a session: into the session's own layer of a `pip: true` environment when the workspace's
allow-list admits the package index, and a refusal naming the policy at once otherwise.

`sandpool up --egress-allow-ceiling` with a pools file declaring a small `pip: true`
environment (built here, offline, from a local wheel); the package index is an HTTPS
origin on loopback serving one package (tests/egress/origins.py), which the egress
proxy's resolver maps `pypi.example.test` to.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from egress.origins import TEST_NAMES, Certificate, Origin, Tap, make_certificate
from sandbox_env import make_lock, make_wheel
from up_harness import Up, exec_code

from sandpool.edge.keys_cli import mint_token

pytestmark = pytest.mark.timeout(300)


@dataclass
class Stack:
    up: Up
    url: str
    key: Path
    certificate: Certificate
    tap: Tap
    cache: Path

    def client(self, workspace: str, *, admin: bool = False) -> httpx.Client:
        token = mint_token(self.key, workspace, admin=admin, ttl_seconds=3600)
        return httpx.Client(base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {token}"})

    @property
    def index(self) -> str:
        return f"https://pypi.example.test:{self.tap.port}/simple/"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = Path(tempfile.mkdtemp(prefix="spp", dir="/tmp"))
    tmp.chmod(0o755)  # sandboxes without namespaces read the environments built under it in place
    certificate = make_certificate(tmp_path_factory.mktemp("pip-cert"))
    index = Origin(tls=certificate.server_context())
    wheel = make_wheel(tmp / "index", name="egresstest_pkg", version="0.1", source="VALUE = 'from the index'\n")
    index.files[f"/files/{wheel.name}"] = ("application/octet-stream", wheel.read_bytes())
    index.files["/simple/egresstest-pkg/"] = (
        "text/html", f'<html><body><a href="/files/{wheel.name}">{wheel.name}</a></body></html>'.encode())
    tap = Tap(index.port)
    lock = make_lock(tmp / "lock", name="probe_pip", source="WHO = 'pipenv'\n")
    pools = tmp / "pools.yaml"
    pools.write_text(f"environments:\n  - {{name: pipenv, requirements: {lock}, pip: true}}\n"
                     "pools:\n  - {name: default, image: python, warm: 1, ceiling: 3}\n"
                     "  - {name: piper, image: pipenv, warm: 1, ceiling: 3}\n")
    env = {"SANDPOOL_UNSAFE_ALLOW_LOOPBACK_FOR_TESTS": "true", "SANDPOOL_UNSAFE_MODE": "tests",
           "SANDPOOL_RESOLVE_OVERRIDES": ",".join(f"{name}=127.0.0.1" for name in TEST_NAMES)}
    up = Up("--egress-allow-ceiling", f"*:{tap.port}", "--pools-file", str(pools), "--environments-dir",
            str(tmp / "cache"), "--pool-size", "1", "--capacity-wait-seconds", "30", env=env)
    try:
        url = up.printed("SANDPOOL_URL=", timeout=240)
        yield Stack(up, url, up.data_dir / "auth" / "dev-key.pem", certificate, tap, tmp / "cache")
    finally:
        up.cleanup()
        tap.close()
        index.close()
        shutil.rmtree(tmp, ignore_errors=True)


def session(stack: Stack, http: httpx.Client, image: str) -> str:
    created = http.post("/sessions", json={"image": image})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    exec_code(http, sid, f"open('ca.pem', 'w').write({stack.certificate.cert.read_text()!r})")
    return sid


def bash(http: httpx.Client, sid: str, command: str) -> dict:
    response = http.post(f"/sessions/{sid}/exec", json={"tool": "bash_code_execution", "input": {"command": command}})
    assert response.status_code == 200, response.text
    return response.json()["result_block"]["content"]


def test_pip_installs_into_the_sessions_own_layer_when_the_index_is_allowed(stack: Stack) -> None:
    with stack.client("ops", admin=True) as admin:
        put = admin.put("/v1/workspaces/pipok/policy", json={"egress_allow": [f"pypi.example.test:{stack.tap.port}"]})
        assert put.status_code == 200, put.text
    with stack.client("pipok") as http:
        sid = session(stack, http, "pipenv")
        before = exec_code(http, sid, "import importlib.util; print(importlib.util.find_spec('egresstest_pkg'))")
        assert before["stdout"] == "None\n"
        done = bash(http, sid, f"pip install --index-url {stack.index} --cert ca.pem egresstest-pkg")
        assert done["return_code"] == 0, done["stdout"] + done["stderr"]
        assert "Successfully installed egresstest-pkg-0.1" in done["stdout"]
        # the interpreter that was already running imports it, from the session's layer
        imported = exec_code(http, sid, "import egresstest_pkg; print(egresstest_pkg.VALUE); "
                                        "print(egresstest_pkg.__file__)")
        value, where = imported["stdout"].splitlines()
        assert value == "from the index", imported["stderr"]
        assert where.startswith("/workspace/.local/lib/python3.") and "/site-packages/" in where
        listed = bash(http, sid, "pip list --format freeze")
        assert {"egresstest_pkg==0.1", "probe_pip==1.0"} <= set(listed["stdout"].split()), listed
        assert http.delete(f"/sessions/{sid}").status_code == 204
    # the shared environment is untouched, and the next session starts without the package
    assert list(stack.cache.glob("**/egresstest_pkg*")) == []
    with stack.client("pipok") as http:
        sid = session(stack, http, "pipenv")
        again = exec_code(http, sid, "import importlib.util; print(importlib.util.find_spec('egresstest_pkg'))")
        assert again["stdout"] == "None\n"
        assert http.delete(f"/sessions/{sid}").status_code == 204


def test_pip_fails_at_once_naming_the_policy_when_the_index_is_not_allowed(stack: Stack) -> None:
    with stack.client("pipno") as http:
        sid = session(stack, http, "pipenv")
        refused = bash(http, sid, f"pip install --index-url {stack.index} --cert ca.pem egresstest-pkg")
        assert refused["return_code"] != 0
        last = refused["stderr"].strip().splitlines()[-1]
        assert last.startswith("ERROR: the package index could not be reached: sandpool egress: "
                               f"pypi.example.test:{stack.tap.port} is not on this workspace's egress allow-list "
                               "(workspace policy egress_allow)"), refused["stderr"]
        assert "sandpool admin policy set" in last
        assert http.delete(f"/sessions/{sid}").status_code == 204


def test_an_environment_not_marked_pip_says_so(stack: Stack) -> None:
    with stack.client("pipok") as http:
        sid = session(stack, http, "python")
        said = bash(http, sid, "pip install egresstest-pkg; python -m pip install egresstest-pkg")
        assert said["stderr"].count("not marked `pip: true`") == 2, said
        assert said["return_code"] == 1
        assert http.delete(f"/sessions/{sid}").status_code == 204
