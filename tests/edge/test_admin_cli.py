"""`sandpool admin` for a whole operator session against a real multi-tenant api: usage, sessions, a policy
change, ending a session, revoking a token; and the one-line failures an operator meets."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from testkit import free_port, usage_settled

from .stack import PRINT_1, Stack


def admin(stack: Stack, *args: str, token: str | None = None,
          url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "SANDPOOL_URL": url or stack.api.url}
    if token is not None:
        env["SANDPOOL_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "sandpool", "admin", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(ok(result))


def test_an_operator_session(stack: Stack) -> None:
    stack.sandboxes.publish_agents(2)
    operator = stack.keys.token("ops", admin=True)
    with stack.client("acme") as acme:
        sid = acme.post("/sessions", json={}).json()["session_id"]
        assert acme.post(f"/sessions/{sid}/exec", json=PRINT_1).status_code == 200

    # The Execute is metered just after its answer: read until it shows, exactly once.
    usage = usage_settled(lambda: as_json(admin(stack, "--json", "usage", "--workspace", "acme", token=operator)),
                          lambda u: (u["total"]["executions"], u["total"]["by_tool"]["code_execution"]["executions"]),
                          (1, 1), timeout=30)
    assert usage["total"]["sessions_created"] == 1
    table = ok(admin(stack, "usage", "--workspace", "acme", token=operator))
    assert "workspace acme" in table and "code_execution" in table and "sessions_created" in table

    listed = ok(admin(stack, "sessions", "--workspace", "acme", token=operator))
    assert sid in listed and "ends at" in listed

    changed = as_json(admin(stack, "--json", "policy", "set", "acme", "max_concurrent_sessions=3",
                            "allowed_images=python", token=operator))
    assert changed["policy"]["max_concurrent_sessions"] == 3 and changed["policy"]["allowed_images"] == ["python"]
    again = as_json(admin(stack, "--json", "policy", "set", "acme", "requests_per_minute=100", token=operator))
    assert again["policy"]["max_concurrent_sessions"] == 3  # a change keeps the other fields
    assert "in force" in ok(admin(stack, "policy", "get", "acme", token=operator))

    ended = ok(admin(stack, "end-session", sid, token=operator))
    assert f"ended session {sid} of workspace acme" in ended
    with stack.client("acme") as acme:
        assert acme.post(f"/sessions/{sid}/exec", json=PRINT_1).status_code == 404
    missing = admin(stack, "end-session", sid, token=operator)
    assert missing.returncode == 1 and missing.stderr.startswith("sandpool admin: not found")

    leaked = stack.keys.token("acme")
    assert "revoked jti" in ok(admin(stack, "revoke", leaked, token=operator))
    with stack.client("acme") as acme:
        acme.headers["Authorization"] = f"Bearer {leaked}"
        assert acme.get("/v1/usage").status_code == 401


def test_failures_are_one_line_an_operator_can_act_on(stack: Stack) -> None:
    workspace_token = stack.keys.token("acme")
    forbidden = admin(stack, "policy", "get", "acme", token=workspace_token)
    assert forbidden.returncode == 1 and forbidden.stdout == ""
    assert forbidden.stderr.startswith("sandpool admin: not allowed:") and "--admin" in forbidden.stderr
    refused = admin(stack, "usage", token="not-a-token")
    assert refused.stderr.startswith("sandpool admin: the token was refused") and refused.returncode == 1
    away = admin(stack, "usage", token=workspace_token, url=f"http://127.0.0.1:{free_port()}")
    assert away.stderr.startswith("sandpool admin: cannot reach sandpool at http://127.0.0.1:")
    bad = admin(stack, "policy", "set", "acme", "max_concurrent_sessions=lots",
                token=stack.keys.token("ops", admin=True))
    assert bad.stderr.strip() == "sandpool admin: max_concurrent_sessions: 'lots' is not an integer (or null)"
    for result in (forbidden, refused, away, bad):
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_token_prints_its_jti_and_expiry_on_stderr_and_only_the_token_on_stdout(stack: Stack) -> None:
    result = subprocess.run([sys.executable, "-m", "sandpool", "token", "--workspace", "acme", "--ttl", "600",
                             "--key", str(stack.keys.private)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip()
    assert token.count(".") == 2 and "\n" not in token
    from sandpool.client.admin import token_claims

    claims = token_claims(token)
    assert f"jti={claims['jti']}" in result.stderr and "expires=" in result.stderr and "workspace=acme" in result.stderr
