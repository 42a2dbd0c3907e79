"""Smoke test of a running sandbox image, through the api's own forwarding code (its session layer).

Runs inside the control-plane image, in the sandbox pod's network namespace
(`podman run --network container:<sandbox>`), as the api reaches a pod:

    python sandbox_smoke.py PORT HEALTH_PATH SECRET_FILE UID

Calls go through `sandpool.sessions.forward` (the pooled agent clients and the
header rules of a forwarded call), so the agent sees exactly what the api
sends it. Every check prints one line; the first failure ends the run with
exit 1 and says what was expected.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from sandpool.core.hop import HopError
from sandpool.sessions.forward import AgentClients, request_headers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STACK = ("numpy", "pandas", "scipy", "sympy", "matplotlib")


class SmokeFailure(Exception):
    pass


def check(ok: bool, what: str, detail: Any = "") -> None:
    if not ok:
        raise SmokeFailure(f"{what}: {detail}")
    print(f"images: sandbox ok: {what}", flush=True)


@dataclass
class Answer:
    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


class Agent:
    def __init__(self, address: str, secret: str) -> None:
        self.clients = AgentClients(max_clients=4, connect_timeout=2.0)
        self.address = address
        self.secret = secret

    def headers(self, secret: str | None, content_type: bool = False) -> list[tuple[str, str]]:
        incoming = [(b"content-type", b"application/json")] if content_type else []
        headers = request_headers(incoming, secret=secret or "", request_id=uuid.uuid4().hex)
        if secret is None:
            headers = [(name, value) for name, value in headers if name != "authorization"]
        return headers

    async def request(self, method: str, path: str, *, secret: str | None = "", content: bytes | None = None,
                      params: dict[str, str] | None = None, timeout: float = 30.0) -> Answer:
        slot = self.clients.take(self.address)
        try:
            headers = self.headers(self.secret if secret == "" else secret, content_type=content is not None)
            target = f"{path}?{urlencode(params)}" if params else path
            response = await slot.pool.request(method, target, headers, body=content, timeout=timeout)
            try:
                return Answer(response.status, await response.read())
            finally:
                await response.close()
        finally:
            self.clients.give_back(slot)

    async def exec(self, tool: str, **fields: Any) -> dict[str, Any]:
        body = json.dumps({"tool": tool, "input": fields}).encode()
        resp = await self.request("POST", "/sessions/ci-smoke/exec", content=body, timeout=120)
        if resp.status_code != 200:
            raise SmokeFailure(f"{tool} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json()["result_block"]["content"]

    async def py(self, code: str) -> dict[str, Any]:
        return await self.exec("code_execution", code=code)

    async def sh(self, command: str) -> dict[str, Any]:
        return await self.exec("bash_code_execution", command=command)


async def wait_healthy(agent: Agent, path: str, timeout: float = 90.0) -> float:
    start = time.monotonic()
    while True:
        try:
            if (await agent.request("GET", path, secret=None, timeout=2)).status_code == 200:
                return time.monotonic() - start
        except HopError:
            pass
        if time.monotonic() - start > timeout:
            raise SmokeFailure(f"the agent did not answer {path} within {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def smoke(port: int, health: str, secret: str, uid: int) -> None:
    agent = Agent(f"http://127.0.0.1:{port}", secret)
    try:
        waited = await wait_healthy(agent, health)
        print(f"images: sandbox agent ready after {waited:.1f} s", flush=True)

        exec_body = json.dumps({"tool": "code_execution", "input": {"code": "print(1)"}}).encode()
        for name, given in (("without the secret", None), ("with a wrong secret", "not-" + secret)):
            resp = await agent.request("POST", "/sessions/ci-smoke/exec", secret=given, content=exec_body)
            check(resp.status_code == 401, f"an exec {name} is refused (401)", resp.status_code)

        out = await agent.py("print(1)")
        check((out["stdout"], out["return_code"]) == ("1\n", 0), "print(1) prints 1", out)

        # matplotlib first: the first import in the sandbox must read the image's font cache, not rebuild it.
        out = await agent.py(
            "import glob, os, time\n"
            "before = time.time()\n"
            "t = time.perf_counter()\n"
            "import matplotlib.pyplot as plt\n"
            "took = time.perf_counter() - t\n"
            "fig, ax = plt.subplots()\n"
            "ax.plot([0, 1, 2], [0, 1, 4])\n"
            "fig.savefig('figure.png')\n"
            "caches = glob.glob(os.path.join(os.environ['MPLCONFIGDIR'], 'fontlist-v*.json'))\n"
            "rebuilt = [c for c in caches if os.stat(c).st_mtime >= before]\n"
            "print(round(took, 3), os.environ['MPLCONFIGDIR'], len(caches), len(rebuilt))\n")
        check(out["return_code"] == 0 and out["stderr"] == "",
              "matplotlib imports without a warning, and savefig works", out)
        took, mpldir, caches, rebuilt = out["stdout"].split()
        print(f"images: sandbox first `import matplotlib.pyplot` took {took} s (MPLCONFIGDIR {mpldir})", flush=True)
        check(not mpldir.startswith("/workspace") and caches == "1" and rebuilt == "0",
              "MPLCONFIGDIR is outside the workspace; the first import read the pre-built font cache (not rewritten)",
              out["stdout"])
        produced = sorted(f["file_id"] for f in out.get("content", []))
        check(produced == ["figure-1.png", "figure.png"],
              "the saved figure and the one left open (saved as figure-1.png) are the exec's produced files", produced)
        got = await agent.request("GET", "/sessions/ci-smoke/files", params={"path": "figure.png"})
        check(got.status_code == 200 and got.content.startswith(PNG_MAGIC) and len(got.content) > 1000,
              f"GetFile returns the PNG ({len(got.content)} bytes)", got.status_code)
        listed = await agent.request("GET", "/sessions/ci-smoke/files/list", params={"path": "."})
        names = sorted(entry["path"] for entry in listed.json()["files"]) if listed.status_code == 200 else []
        check(listed.status_code == 200 and names == ["figure-1.png", "figure.png"],
              "the workspace holds only the figures (no matplotlib cache or config)", listed.text[:300])

        out = await agent.py(
            "import numpy, pandas, scipy, scipy.linalg, sympy, matplotlib\n"
            "a = numpy.array([[2.0, 1.0], [1.0, 3.0]])\n"
            "assert abs(scipy.linalg.det(a) - 5.0) < 1e-9\n"
            "assert pandas.DataFrame({'x': [1, 2, 3]})['x'].sum() == 6\n"
            "x = sympy.symbols('x')\n"
            "assert sympy.integrate(2 * x, x) == x**2\n"
            f"print(' '.join(m.__name__ + '=' + m.__version__ for m in ({', '.join(STACK)})))\n")
        check(out["return_code"] == 0 and out["stderr"] == "", "the scientific stack imports and computes", out)
        versions = dict(word.split("=") for word in out["stdout"].split())
        print(f"images: sandbox stack {out['stdout'].strip()}", flush=True)

        out = await agent.sh("command -v python; python -c 'import numpy; print(numpy.__version__)'")
        lines = out["stdout"].splitlines()
        check(out["return_code"] == 0 and lines[-1:] == [versions["numpy"]],
              f"`python -c 'import numpy'` works in bash ({lines[0] if lines else '?'})", out)

        out = await agent.sh("id -u; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status")
        facts = dict(line.split(":", 1) for line in out["stdout"].splitlines()[1:])
        facts = {k: v.strip() for k, v in facts.items()}
        check(out["stdout"].splitlines()[0] == str(uid), f"sandboxed code runs as uid {uid}", out["stdout"])
        check(facts == {"CapEff": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"},
              "no capabilities, no new privileges, a seccomp filter", facts)

        out = await agent.sh("touch /opt/sandpool/written 2>&1; mkdir /written 2>&1; echo rc=$?")
        check(out["stdout"].count("Read-only file system") == 2 and out["stdout"].endswith("rc=1\n"),
              "writes to the root file system are refused (read-only)", out["stdout"])
        out = await agent.py("open('/usr/lib/written', 'w')")
        check(out["return_code"] == 1 and "Read-only file system" in out["stderr"],
              "Python cannot write to the root file system either", out["stderr"][-200:])
    finally:
        await agent.clients.aclose()


def main() -> int:
    port, health, secret_file, uid = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    with open(secret_file) as fh:
        secret = fh.read().strip()
    try:
        asyncio.run(smoke(port, health, secret, uid))
    except SmokeFailure as exc:
        print(f"images: sandbox FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
