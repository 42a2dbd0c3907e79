"""`helm test`: one session end to end through the proxy.

Mints a short-lived token with the release's signing key (sandpool's own
`mint_token`, so the kid is the key's thumbprint, as the proxy expects),
creates a session, runs print(1), checks the result and destroys the session.
Exits non-zero with a one-line reason on any failure. Runs in the control-plane
image; configured by environment:

  SMOKE_URL        base URL of the proxy
  SMOKE_KEY        path of the Ed25519 private key (PEM)
  SMOKE_AUDIENCE   the `aud` claim
  SMOKE_WORKSPACE  the `workspace` claim
  SMOKE_TIMEOUT    seconds to wait for a ready sandbox (default 120)
"""

from __future__ import annotations

import os
import sys
import time

import httpx

from sandpool.edge.keys_cli import mint_token


def fail(message: str) -> int:
    print(f"smoke test FAILED: {message}", file=sys.stderr)
    return 1


def main() -> int:
    env = os.environ
    url = env["SMOKE_URL"].rstrip("/")
    token = mint_token(env["SMOKE_KEY"], env.get("SMOKE_WORKSPACE", "helm-test"), ttl_seconds=300,
                       audience=env.get("SMOKE_AUDIENCE", "sandpool"), subject="helm-test")
    deadline = time.monotonic() + float(env.get("SMOKE_TIMEOUT", "120"))
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30.0) as client:
        # A fresh installation may still be warming its pool: 503 means "try again".
        while True:
            created = client.post("/sessions", json={})
            if created.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(min(float(created.headers.get("Retry-After", "1")), 5.0))
        if created.status_code not in (200, 201):
            return fail(f"CreateSession answered {created.status_code}: {created.text[:200]}")
        session_id = created.json()["session_id"]
        try:
            ran = client.post(f"/sessions/{session_id}/exec",
                              json={"tool": "code_execution", "input": {"code": "print(1)"}})
            if ran.status_code != 200:
                return fail(f"Execute answered {ran.status_code}: {ran.text[:200]}")
            content = ran.json()["result_block"]["content"]
            if content.get("stdout") != "1\n" or content.get("return_code") != 0:
                return fail(f"print(1) gave {content!r}")
        finally:
            destroyed = client.delete(f"/sessions/{session_id}")
        if destroyed.status_code not in (200, 204):
            return fail(f"DestroySession answered {destroyed.status_code}")
    print(f"smoke test passed: session {session_id} ran print(1) and was destroyed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
