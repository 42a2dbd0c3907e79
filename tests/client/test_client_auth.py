"""The client against the multi-tenant api of a real `sandpool up`: the printed token works, others are 401."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from client_stack import Stack
from test_metrics_live import problems_of

from sandpool.client import Client, ImageNotAllowed, QuotaExceeded, Unauthorized

pytestmark = pytest.mark.timeout(60)


def test_the_printed_token_runs_code(auth_stack: Stack) -> None:
    with Client.from_env(auth_stack.env, max_retries=20) as client, client.session() as s:
        assert s.run_python("print(6 * 7)").stdout == "42\n"
        assert s.upload("a.txt", b"hi").size_bytes == 2
        assert s.download("a.txt") == b"hi"


@pytest.mark.parametrize("token", [None, "not-a-jwt", "eyJhbGciOiJIUzI1NiJ9.eyJ3b3Jrc3BhY2UiOiJ4In0.c2ln"])
def test_a_missing_or_bad_token_is_unauthorized_and_not_retried(auth_stack: Stack, token: str | None) -> None:
    with Client(auth_stack.url, token=token) as client, pytest.raises(Unauthorized) as info:
        client.create_session()
    err = info.value
    assert (err.status, err.reason, err.retryable, err.attempts) == (401, "unauthorized", False, 1)
    assert isinstance(err.body.get("cause"), str)  # sandpool says why (missing_token, malformed_token, ...)


def test_a_valid_token_cannot_reach_a_session_by_guessing_another_id(auth_stack: Stack) -> None:
    with Client.from_env(auth_stack.env, max_retries=20) as client:
        client.destroy_session("someone-elses-session")  # 204: nothing learned, nothing touched


def test_multi_tenant_api_metrics_match_the_architecture_table(auth_stack: Stack) -> None:
    with Client.from_env(auth_stack.env, max_retries=20) as client, client.session() as s:
        s.run_python("print(1)")
    with Client(auth_stack.url, token="not-a-jwt") as stranger, pytest.raises(Unauthorized):
        stranger.create_session()  # so an auth failure is counted
    assert problems_of(auth_stack.url, "api") == []


def test_workspace_policy_refusals_map_to_forbidden_and_quota(auth_stack: Stack) -> None:
    """403 image_not_allowed (the edge) and 429 quota_exceeded (the lease), as the client raises them."""
    key = auth_stack.data_dir / "auth" / "dev-key.pem"
    minted = subprocess.run([sys.executable, "-m", "sandpool", "token", "--workspace", "ops", "--admin",
                             "--key", str(key), "--ttl", "600"], capture_output=True, text=True, timeout=30)
    assert minted.returncode == 0, minted.stderr
    admin = {"Authorization": f"Bearer {minted.stdout.strip()}"}
    policy_url = f"{auth_stack.url}/v1/workspaces/dev/policy"
    put = httpx.put(policy_url, json={"allowed_images": ["python"], "max_concurrent_sessions": 1}, headers=admin,
                    timeout=10)
    assert put.status_code == 200, put.text
    try:
        with Client.from_env(auth_stack.env, max_retries=1, max_retry_wait=5) as client:
            with pytest.raises(ImageNotAllowed) as refused:
                client.create_session(image="not-allowed")
            assert (refused.value.status, refused.value.retryable) == (403, False)
            assert refused.value.body["allowed_images"] == ["python"]
            with client.session(image="python") as held:
                assert held.info.image == "python"
                with pytest.raises(QuotaExceeded) as quota:
                    client.create_session()
                err = quota.value
                assert (err.status, err.retryable, err.limit, err.attempts) == (429, True, "max_concurrent_sessions", 2)
                assert err.retry_after is not None
                assert held.run_python("print('the held session is untouched')").ok
    finally:
        httpx.put(policy_url, json={}, headers=admin, timeout=10)
