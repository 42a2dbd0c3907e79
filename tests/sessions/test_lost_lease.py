"""A lease that Redis forgot (a failover lost it) gives the sandbox out twice; the agent's fence
(DESIGN.md, "Redis") refuses the second session, and the api answers it as a session whose sandbox is
gone: never with the first session's state.

The lost lease is simulated as a failover leaves it: the first session's sandbox appears in the
pool's ready list again (the same agent published as a sandbox record Redis knows nothing else of),
and a new CreateSession leases it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sessions_harness import publish
from testkit import wait_for


def code(source: str) -> dict[str, object]:
    return {"tool": "code_execution", "input": {"code": source}}


SECOND_CALLS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "execute": ("POST", "exec", {"json": code("print(x)")}),
    "streamed execute": ("POST", "exec", {"json": code("print(x)"), "headers": {"Accept": "text/event-stream"}}),
    "put file": ("POST", "files", {"files": {"file": ("mine.txt", b"overwritten")}, "data": {"path": "mine.txt"}}),
    "get file": ("GET", "files", {"params": {"path": "mine.txt"}}),
    "list files": ("GET", "files/list", {}),
}


@pytest.mark.parametrize("call", list(SECOND_CALLS))
def test_a_second_lease_of_one_sandbox_is_refused_and_ends_it(api, agents, r, keys, call: str) -> None:
    """Whatever the second session's first call (the agent refuses it before reading an upload)."""
    app = api()
    (agent,) = agents.start(1)
    publish(r, keys, address=agent.address, secret=agent.secret)
    with httpx.Client(base_url=app.url, timeout=30) as c:
        first = c.post("/sessions", json={}).json()["session_id"]
        kept = c.post(f"/sessions/{first}/exec", json=code("x = 42\nopen('mine.txt', 'w').write('first session')"))
        assert kept.status_code == 200, kept.text

        twice = publish(r, keys, address=agent.address, secret=agent.secret)  # the forgotten lease
        second = c.post("/sessions", json={}).json()["session_id"]
        assert r.hget(keys.session(second), "sandbox") == twice

        method, path, kwargs = SECOND_CALLS[call]
        refused = c.request(method, f"/sessions/{second}/{path}", **kwargs)
        assert refused.status_code == 503, refused.text
        assert refused.json()["reason"] == "sandbox_unavailable"
        assert "serving another session" in refused.json()["detail"]
        assert "42" not in refused.text and "first session" not in refused.text
        assert "x-sandpool-fenced" not in refused.headers

        # The refused session is gone (released as dead, its sandbox doomed for the controller) ...
        assert c.get(f"/sessions/{second}/files", params={"path": "mine.txt"}).status_code == 404
        assert r.hget(keys.sandbox(twice), "state") == "doomed" and r.sismember(keys.doomed, twice)
        released = [e[1] for e in r.xrange(keys.usage_events) if e[1]["type"] == "session_released"]
        assert [(e["session"], e["reason"]) for e in released] == [(second, "dead")]

        # ... and so is the sandbox: its agent exits, and the first session's next call finds it gone.
        wait_for(lambda: agent.proc.poll() is not None, timeout=15, what="the fenced agent to exit")
        after = c.post(f"/sessions/{first}/exec", json=code("print(x)"))
        assert after.status_code in (502, 503) and "42" not in after.text, after.text
        assert c.get(f"/sessions/{first}").status_code == 404
    assert (agent.workspace / "mine.txt").read_text() == "first session"  # the upload was never written
