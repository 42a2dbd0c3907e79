"""Cross-tenant probes through the deployed stack: workspace B against workspace A's session.

Beyond tests/edge/test_e2e.py (every session operation is a 404 to
another workspace): the answers are byte-identical to an unknown id's, injected
`X-Sandpool-*` headers do not help, the admin API does not open A's usage,
sessions or policy to B, and A's usage is not moved by any of B's probes.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
from sp_harness import Stack
from testkit import usage_settled

PROBES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/sessions/{sid}/exec", {"json": {"tool": "bash_code_execution", "input": {"command": "cat a.txt"}}}),
    ("GET", "/sessions/{sid}/files/list", {}),
    ("GET", "/sessions/{sid}/files", {"params": {"path": "a.txt"}}),
    ("POST", "/sessions/{sid}/files", {"files": {"file": ("a.txt", b"overwritten")}}),
]
INJECTED = [{}, {"X-Sandpool-Workspace": "tenant-a"},
            {"x-sandpool-workspace": "tenant-a", "X-Sandpool-Max-Concurrent-Sessions": "0"},
            {"Authorization": "Bearer x", "X-Sandpool-Workspace": "tenant-a"}]


def usage(admin: httpx.Client, workspace: str) -> dict[str, Any]:
    response = admin.get("/v1/usage", params={"workspace": workspace})
    assert response.status_code == 200, response.text
    return response.json()["total"] if "total" in response.json() else response.json()


def test_another_workspace_learns_nothing_and_changes_nothing(stack: Stack) -> None:
    a, b, admin = stack.client("tenant-a"), stack.client("tenant-b"), stack.client("ops", admin=True)
    try:
        sid = a.post("/sessions", json={}).json()["session_id"]
        uploaded = usage(admin, "tenant-a")["bytes_uploaded"]
        assert a.post(f"/sessions/{sid}/files", files={"file": ("a.txt", b"tenant-a data")}).status_code == 201
        # The upload is metered just after its answer: A's usage before the probes includes it, once.
        before = usage_settled(lambda: usage(admin, "tenant-a"), lambda u: u["bytes_uploaded"],
                               uploaded + len(b"tenant-a data"))
        unknown = "s" + uuid.uuid4().hex
        for injected in INJECTED:
            for method, template, kwargs in PROBES:
                probe = b.request(method, template.format(sid=sid), headers={**b.headers, **injected}, **kwargs)
                blank = b.request(method, template.format(sid=unknown), headers={**b.headers, **injected}, **kwargs)
                assert probe.status_code == 404, (template, injected, probe.text)
                assert probe.content == blank.content, (probe.text, blank.text)  # not even a hint it exists
                assert sorted(k for k in probe.headers if k != "x-request-id" and k != "date") == \
                    sorted(k for k in blank.headers if k != "x-request-id" and k != "date")
            destroy = b.delete(f"/sessions/{sid}", headers={**b.headers, **injected})
            assert destroy.status_code == 204
        # Admin API: B reads and writes only its own workspace.
        for method, url, kwargs in [("GET", "/v1/usage", {"params": {"workspace": "tenant-a"}}),
                                    ("GET", "/v1/sessions", {"params": {"workspace": "tenant-a"}}),
                                    ("GET", "/v1/workspaces/tenant-a/policy", {}),
                                    ("PUT", "/v1/workspaces/tenant-a/policy", {"json": {"max_concurrent_sessions": 1}}),
                                    ("POST", "/v1/revocations", {"json": {"jti": "anything", "ttl": 60}})]:
            response = b.request(method, url, **kwargs)
            assert response.status_code == 403, (url, response.text)
            assert "tenant-a data" not in response.text and sid not in response.text
        own = b.get("/v1/sessions")
        assert own.status_code == 200 and sid not in own.text
        # A's session, files and usage are exactly as they were, but for A's own download just now
        # (metered just after its answer).
        assert a.get(f"/sessions/{sid}/files", params={"path": "a.txt"}).content == b"tenant-a data"
        after = usage_settled(lambda: usage(admin, "tenant-a"), lambda u: u["bytes_downloaded"],
                              before["bytes_downloaded"] + len(b"tenant-a data"))
        assert after == {**before, "bytes_downloaded": before["bytes_downloaded"] + len(b"tenant-a data")}
        assert a.delete(f"/sessions/{sid}").status_code == 204
    finally:
        a.close()
        b.close()
        admin.close()
