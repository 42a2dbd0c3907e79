"""The client through the authenticating proxy of a real `sandpool up`: the printed token works, others are 401."""

from __future__ import annotations

import pytest
from client_stack import Stack
from test_metrics_live import problems_of

from sandpool.client import Client, Unauthorized

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


def test_proxy_metrics_match_the_architecture_table(auth_stack: Stack) -> None:
    with Client.from_env(auth_stack.env, max_retries=20) as client, client.session() as s:
        s.run_python("print(1)")
    with Client(auth_stack.url, token="not-a-jwt") as stranger, pytest.raises(Unauthorized):
        stranger.create_session()  # so an auth failure is counted
    assert problems_of(auth_stack.url, "proxy") == []
