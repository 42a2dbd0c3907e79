"""Pure pieces of the client: status → exception, Retry-After parsing, backoff bounds, timeouts, result parsing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandpool.client import (
    AtCapacity,
    BadRequest,
    ExecResult,
    Forbidden,
    ImageNotAllowed,
    InvalidRequest,
    NotFound,
    PathOutsideWorkspace,
    PayloadTooLarge,
    ProtocolError,
    QuotaExceeded,
    RetryPolicy,
    SandboxFailed,
    SandpoolClientError,
    ServerError,
    SessionInfo,
    Unauthorized,
    Unavailable,
)
from sandpool.client.calls import Timeouts, execute, put_file
from sandpool.client.config import ClientConfig
from sandpool.client.errors import error_from_response
from sandpool.client.retry import parse_retry_after

# --- status + headers + body -> exception ----------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason", "cls", "retryable"),
    [
        (400, "unknown_tool_kind", BadRequest, False),
        (401, "unauthorized", Unauthorized, False),
        (403, "forbidden", Forbidden, False),
        (403, "path_outside_workspace", PathOutsideWorkspace, False),
        (404, "not_found", NotFound, False),
        (413, "payload_too_large", PayloadTooLarge, False),
        (422, "invalid_request", InvalidRequest, False),
        (429, "quota_exceeded", QuotaExceeded, True),
        (502, "sandbox_failed", SandboxFailed, True),
        (503, "at_capacity", AtCapacity, True),
        (503, "unavailable", Unavailable, True),
        (503, "redis_unavailable", Unavailable, True),
        (503, "sandbox_unavailable", Unavailable, True),
        (403, "image_not_allowed", ImageNotAllowed, False),
        (500, "internal_error", ServerError, False),
        (409, None, BadRequest, False),
    ],
)
def test_status_maps_to_named_error(status: int, reason: str | None, cls: type, retryable: bool) -> None:
    body = {"detail": "something", "reason": reason} if reason else {"detail": "something"}
    err = error_from_response(status, httpx.Headers({}), body)
    assert type(err) is cls
    assert isinstance(err, SandpoolClientError)
    assert err.status == status
    assert err.retryable is retryable
    assert err.detail == "something"
    assert str(err).startswith("something")


def test_unavailable_is_not_at_capacity_but_at_capacity_is_unavailable() -> None:
    assert issubclass(AtCapacity, Unavailable)
    assert not isinstance(error_from_response(503, {}, {"reason": "unavailable"}), AtCapacity)


def test_503_without_a_body_is_at_capacity_as_the_contract_means_it() -> None:
    err = error_from_response(503, httpx.Headers({"Retry-After": "3"}), None)
    assert isinstance(err, AtCapacity)
    assert err.reason == "at_capacity"  # the class's default when the server sent none
    assert err.retry_after == 3.0
    assert err.retryable


def test_422_is_a_bad_request_and_its_validation_detail_reads_well() -> None:
    body = {"detail": [{"loc": ["body", "input", "code"], "msg": "Field required", "type": "missing"}],
            "reason": "invalid_request"}
    err = error_from_response(422, {}, body)
    assert isinstance(err, BadRequest)
    assert "input.code: Field required" in str(err)


def test_extension_fields_of_the_error_body_are_kept() -> None:
    err = error_from_response(429, httpx.Headers({"retry-after": "7"}),
                              {"detail": "budget", "reason": "quota_exceeded", "limit": "daily_session_seconds"})
    assert err.body["limit"] == "daily_session_seconds"
    assert isinstance(err, QuotaExceeded) and err.limit == "daily_session_seconds"
    assert err.retry_after == 7.0


@pytest.mark.parametrize("body", [None, [], "text", {"reason": 5}, {"reason": ""}])
def test_odd_error_bodies_still_map_by_status(body: object) -> None:
    err = error_from_response(404, {}, body)
    assert isinstance(err, NotFound)
    assert err.reason == "not_found"
    assert "404" in str(err)


# --- Retry-After -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("5", 5.0), (" 7 ", 7.0), ("0", 0.0), ("1.5", 1.5), (None, None), ("", None), ("soon", None),
     ("-1", None), ("nan", None), ("inf", None)],
)
def test_parse_retry_after_seconds(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value) == expected


def test_parse_retry_after_http_date() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=30), usegmt=True)
    earlier = format_datetime(now - timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(later, now=now) == 30.0
    assert parse_retry_after(earlier, now=now) == 0.0


# --- backoff bounds --------------------------------------------------------------------------------


def test_backoff_without_header_is_jittered_within_half_cap_to_cap() -> None:
    policy = RetryPolicy(max_retries=10, max_total_wait=1000, base_backoff=0.2, max_backoff=5.0)
    for n in range(10):
        cap = min(5.0, 0.2 * 2**n)
        assert policy.next_delay(n, retry_after=None, waited=0, rng=lambda: 0.0) == pytest.approx(cap / 2)
        assert policy.next_delay(n, retry_after=None, waited=0, rng=lambda: 1.0) == pytest.approx(cap)
    assert policy.backoff_cap(1000) == 5.0


def test_retry_after_is_honoured_with_at_most_ten_percent_jitter() -> None:
    policy = RetryPolicy(max_retries=3, max_total_wait=100)
    assert policy.next_delay(0, retry_after=4, waited=0, rng=lambda: 0.0) == 4
    assert policy.next_delay(0, retry_after=4, waited=0, rng=lambda: 1.0) == pytest.approx(4.4)
    assert policy.next_delay(0, retry_after=50, waited=0, rng=lambda: 1.0) == pytest.approx(51)  # jitter <= 1 s


def test_gives_up_after_max_retries_and_beyond_the_wait_budget() -> None:
    policy = RetryPolicy(max_retries=2, max_total_wait=10)
    assert policy.next_delay(2, retry_after=0, waited=0) is None
    assert policy.next_delay(0, retry_after=11, waited=0, rng=lambda: 0.0) is None  # asks for more than allowed
    assert policy.next_delay(1, retry_after=3, waited=8, rng=lambda: 0.0) is None
    assert RetryPolicy(max_retries=0).next_delay(0, retry_after=0, waited=0) is None


def test_retry_policy_rejects_negative_bounds() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="waits"):
        RetryPolicy(max_total_wait=-1)


@settings(max_examples=60, deadline=None)  # pure arithmetic; no deadline to trip on a loaded CI host
@given(
    retries=st.integers(0, 8),
    budget=st.floats(0, 60),
    after=st.lists(st.one_of(st.none(), st.floats(0, 20)), min_size=10, max_size=10),
    rolls=st.lists(st.floats(0, 1), min_size=10, max_size=10),
)
def test_total_wait_and_count_never_exceed_the_policy(retries: int, budget: float, after: list[float | None],
                                                      rolls: list[float]) -> None:
    policy = RetryPolicy(max_retries=retries, max_total_wait=budget)
    waited, n = 0.0, 0
    while True:
        delay = policy.next_delay(n, retry_after=after[n % 10], waited=waited, rng=lambda roll=rolls[n % 10]: roll)
        if delay is None:
            break
        assert delay >= 0
        waited += delay
        n += 1
    assert n <= retries
    assert waited <= budget + 1e-9


# --- timeouts --------------------------------------------------------------------------------------


def _read_timeout(timeout_seconds: int | None, default: int | None = None, ceiling: int | None = None) -> float:
    t = Timeouts(request=30, exec_margin=10, exec_default=300)
    call = execute(t, "s", "code_execution", {"code": "1"}, timeout_seconds=timeout_seconds, tool_use_id=None,
                   session_exec_timeout=default, session_max_exec_timeout=ceiling)
    assert call.timeout.read is not None
    return call.timeout.read


def test_exec_timeout_exceeds_the_granted_execution_time_by_the_margin() -> None:
    assert _read_timeout(100) == 110
    assert _read_timeout(100, default=60, ceiling=300) == 110
    # A request above the session's ceiling runs for the ceiling only.
    assert _read_timeout(500, default=60, ceiling=300) == 310
    # No timeout asked: the session's default in force, else its ceiling, else the client's assumption.
    assert _read_timeout(None, default=60, ceiling=300) == 70
    assert _read_timeout(None, ceiling=120) == 130
    assert _read_timeout(None) == 310
    # Never below the plain request timeout.
    assert _read_timeout(1) == 30


def test_exec_body_carries_only_what_was_given() -> None:
    call = execute(Timeouts(), "s", "code_execution", {"code": "1"}, timeout_seconds=100, tool_use_id="u")
    assert call.json == {"tool": "code_execution", "input": {"code": "1"}, "timeout_seconds": 100,
                         "tool_use_id": "u"}
    bare = execute(Timeouts(), "s", "code_execution", {"code": "1"}, timeout_seconds=None, tool_use_id=None)
    assert bare.json == {"tool": "code_execution", "input": {"code": "1"}}


def test_session_ids_are_escaped_into_the_path() -> None:
    call = execute(Timeouts(), "a/../b c", "code_execution", {"code": "1"}, timeout_seconds=None, tool_use_id=None,
                   session_exec_timeout=None)
    assert call.path == "/sessions/a%2F..%2Fb%20c/exec"
    with pytest.raises(ValueError):
        execute(Timeouts(), "", "x", {}, timeout_seconds=None, tool_use_id=None, session_exec_timeout=None)


def test_upload_refuses_text_and_empty_paths() -> None:
    with pytest.raises(TypeError, match="bytes"):
        put_file(Timeouts(), "s", "a.txt", "text")  # type: ignore[arg-type]  # a str, on purpose: refused
    with pytest.raises(ValueError):
        put_file(Timeouts(), "s", "", b"x")


# --- configuration ---------------------------------------------------------------------------------


def _config(url: str, token: str | None = None) -> ClientConfig:
    return ClientConfig.build(url, token, timeout=30, max_retries=3, max_retry_wait=30, exec_timeout_margin=10,
                              default_exec_timeout=300, headers=None)


def test_config_checks_the_url_and_token() -> None:
    assert _config("http://h:1/prefix/").url("/sessions") == "http://h:1/prefix/sessions"
    assert _config("https://h", "tok").headers["Authorization"] == "Bearer tok"
    assert "Authorization" not in _config("http://h").headers
    for bad in ("ftp://h", "h:8080", "http://", "http://h/?q=1"):
        with pytest.raises(ValueError, match="base_url"):
            _config(bad)
    with pytest.raises(ValueError, match="single line"):
        _config("http://h", "a\r\nX-Evil: 1")


def test_config_from_env() -> None:
    assert ClientConfig.from_env({"SANDPOOL_URL": "http://h:1", "SANDPOOL_TOKEN": " t "}) == ("http://h:1", "t")
    assert ClientConfig.from_env({"SANDPOOL_URL": "http://h:1"}) == ("http://h:1", None)
    with pytest.raises(ValueError, match="SANDPOOL_URL"):
        ClientConfig.from_env({})


# --- result parsing --------------------------------------------------------------------------------


def _exec_body(**content: object) -> dict:
    return {"tool_use_id": "t1", "execution_time_ms": 5, "limit_exceeded": "timeout", "timeout_seconds": 2.0,
            "shell_restarted": True,
            "result_block": {"type": "bash_code_execution_tool_result", "tool_use_id": "t1",
                             "content": {"stdout": "o", "stderr": "e", **content}}}


def test_exec_result_reads_the_nested_envelope_and_keeps_extensions() -> None:
    body = _exec_body(return_code=None, content=[{"file_id": "out/a.png", "filename": "a.png", "size": 3}])
    result = ExecResult.from_body(body)
    assert (result.stdout, result.stderr, result.return_code) == ("o", "e", 0)  # null reads as 0
    assert result.files[0].file_id == "out/a.png" and result.files[0].raw["size"] == 3
    assert result.tool_use_id == "t1" and result.execution_time_ms == 5
    assert result.type == "bash_code_execution_tool_result"
    assert result.timed_out and result.limit == "timeout" and not result.ok
    assert result.timeout_seconds == 2.0 and result.shell_restarted and not result.interpreter_restarted
    assert result.raw == body


def test_exec_result_ok_and_unknown_result_types_are_accepted() -> None:
    body = _exec_body(return_code=0)
    del body["limit_exceeded"], body["shell_restarted"], body["timeout_seconds"]
    body["result_block"]["type"] = "some_future_tool_result"
    plain = ExecResult.from_body(body)
    assert plain.ok and plain.limit is None and not plain.timed_out and plain.timeout_seconds is None
    body["result_block"]["content"]["return_code"] = 2
    assert not ExecResult.from_body(body).ok
    body["result_block"]["content"]["return_code"] = 0
    body["limit_exceeded"] = "output"  # output cut at the cap: the call did not run as written
    assert not ExecResult.from_body(body).ok and not ExecResult.from_body(body).timed_out


@pytest.mark.parametrize(
    "body",
    [
        # the result block returned bare, not under result_block
        {"type": "code_execution_tool_result", "tool_use_id": "t", "content": {"stdout": ""}},
        # content as a list of blocks instead of one object
        {"tool_use_id": "t", "result_block": {"type": "x", "tool_use_id": "t", "content": [{"stdout": ""}]}},
        # a file reference without a file_id
        {"tool_use_id": "t", "result_block": {"type": "x", "tool_use_id": "t",
                                              "content": {"content": [{"filename": "a"}]}}},
        [],
    ],
)
def test_non_conforming_exec_bodies_are_protocol_errors(body: object) -> None:
    with pytest.raises(ProtocolError, match="contract v1") as info:
        ExecResult.from_body(body)
    assert info.value.retryable is False


def test_session_info_reads_sandpool_extensions_when_present() -> None:
    info = SessionInfo.from_body({"session_id": "s", "image": "python:3.12", "pool": "py", "exec_timeout_seconds": 60,
                                  "max_exec_timeout_seconds": 300})
    assert (info.image, info.pool, info.exec_timeout_seconds, info.max_exec_timeout_seconds) == (
        "python:3.12", "py", 60, 300)
    plain = SessionInfo.from_body({"session_id": "s", "exec_timeout_seconds": True})
    assert (plain.image, plain.pool, plain.exec_timeout_seconds, plain.max_exec_timeout_seconds) == (
        None, None, None, None)
    with pytest.raises(ProtocolError):
        SessionInfo.from_body({"session_id": ""})


def test_public_exports_are_pinned() -> None:
    import sandpool.client as client

    assert sorted(client.__all__) == sorted([
        "AsyncClient", "AsyncSession", "AtCapacity", "BadRequest", "Client", "ConnectionFailed", "ConnectionLost",
        "ExecEvent", "ExecResult", "FileInfo", "Forbidden", "ImageNotAllowed", "InvalidRequest", "NotFound",
        "OutputFile", "PathOutsideWorkspace", "PayloadTooLarge", "ProtocolError", "QuotaExceeded", "ResponseTimeout",
        "RetryPolicy", "SandboxFailed", "SandpoolClientError", "ServerError", "Session", "SessionInfo",
        "Unauthorized", "Unavailable", "UploadResult",
    ])
    for name in client.__all__:
        obj = getattr(client, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, client.SandpoolClientError), name
    # The sync and async sessions offer the same calls.
    def public(cls: type) -> set[str]:
        return {n for n in vars(cls) if not n.startswith("_")}

    assert public(client.Session) == public(client.AsyncSession)
    assert public(client.Client) - {"close"} == public(client.AsyncClient) - {"aclose"}


def test_the_stack_fixture_hands_up_its_own_data_dir() -> None:
    # A stack started with some other --data-dir would share sandboxes with other stacks.
    from client_stack import Stack

    stack = Stack(1, ["--pool-size", "1"])
    try:
        assert stack.args[stack.args.index("--data-dir") + 1] == str(stack.data_dir)
        assert stack.data_dir.is_dir() and str(stack.data_dir).startswith("/tmp/spclient")
    finally:
        stack.remove()
