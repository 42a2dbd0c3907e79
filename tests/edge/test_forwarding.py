"""What crosses the proxy: tenancy injected from the token only, bodies byte for byte, clear failures."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable

import httpx
import pytest
import redis
from testkit import ThreadServer, free_port, wait_for

from sandpool.contract import limits as catalogue

from .conftest import INTERNAL_TOKEN, Echo, Keys, Proxy

FORGED = {
    "X-Sandpool-Workspace": "victim",
    "x-sandpool-max-concurrent-sessions": "100000",
    "X-SANDPOOL-DAILY-SESSION-SECONDS-BUDGET": "0",
    "X-Sandpool-Anything-New": "1",
}


def test_inbound_tenancy_headers_are_stripped_and_injected_from_the_token(proxy: Proxy, keys: Keys, echo: Echo,
                                                                          rdb: redis.Redis, redis_prefix: str) -> None:
    rdb.set(f"{{{redis_prefix}}}:policy:acme", json.dumps({"max_concurrent_sessions": 3,
                                                          "daily_session_seconds_budget": 600}))
    with proxy.client(keys.token("acme")) as client:
        response = client.post("/sessions", json={}, headers={**FORGED, "X-Request-Id": "req-42",
                                                              "Proxy-Authorization": "x", "Keep-Alive": "5"})
    assert response.status_code == 201
    assert response.headers["x-request-id"] == "req-42"
    [seen] = echo.seen
    sandpool_headers = {k: v for k, v in seen.headers if k.startswith("x-sandpool-")}
    assert sandpool_headers == {"x-sandpool-workspace": "acme", "x-sandpool-max-concurrent-sessions": "3",
                                "x-sandpool-daily-session-seconds-budget": "600",
                                "x-sandpool-max-idle-timeout-seconds": "0", "x-sandpool-max-lifetime-seconds": "0",
                                "x-sandpool-max-exec-timeout-seconds": "0", "x-sandpool-egress-allow": ""}
    assert seen.header("authorization") == [f"Bearer {INTERNAL_TOKEN}"]
    assert seen.header("x-request-id") == ["req-42"]
    assert seen.header("proxy-authorization") == [] and seen.header("keep-alive") == []


def test_no_policy_sends_every_forwarded_limit_as_none_of_its_own(proxy: Proxy, keys: Keys, echo: Echo) -> None:
    """The scheduler's own ceilings then apply; a limit is never left out (the scheduler refuses that)."""
    with proxy.client(keys.token("beta")) as client:
        assert client.delete("/sessions/s9", headers=FORGED).status_code == 200
    [seen] = echo.seen
    expected = {"x-sandpool-workspace": "beta"} | {
        limit.header.lower(): limit.unset for limit in catalogue.forwarded() if limit.header is not None}
    assert {k: v for k, v in seen.headers if k.startswith("x-sandpool-")} == expected
    assert seen.method == "DELETE" and seen.path == "/sessions/s9"


def test_bodies_and_queries_cross_byte_for_byte(proxy: Proxy, keys: Keys, echo: Echo) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    with proxy.client(keys.token()) as client:
        up = client.post("/sessions/s1/files?path=a%20b.bin",
                         files={"file": ("a b.bin", payload, "application/octet-stream")})
        down = client.get("/sessions/s1/files", params={"path": "x", "size": str(5 * 1024 * 1024)})
        chunked = client.post("/sessions/s1/exec", content=iter([b'{"tool":', b'"bash_code_execution",',
                                                                  b'"input":{"command":"true"}}']))
    assert up.status_code == 200
    assert echo.seen[0].query == "path=a%20b.bin"
    assert up.json()["body_sha256"] == hashlib.sha256(echo.seen[0].body).hexdigest()
    assert payload in echo.seen[0].body
    assert down.status_code == 200 and down.content == b"x" * (5 * 1024 * 1024)
    assert chunked.json()["body_len"] == len(b'{"tool":"bash_code_execution","input":{"command":"true"}}')


def test_upstream_hop_by_hop_and_request_id_headers_are_not_relayed(proxy: Proxy, keys: Keys) -> None:
    with proxy.client(keys.token()) as client:
        response = client.get("/sessions/s1/files", params={"size": "10", "hop": "1"})
        echoed = client.post("/sessions/s1/exec", json={})
    assert response.status_code == 200 and response.content == b"x" * 10
    assert response.headers.get("x-sandpool-outcome") == "ok"  # end-to-end headers are relayed
    assert echoed.headers.get_list("x-request-id") != ["upstream-must-not-leak"]
    assert len(echoed.headers.get_list("x-request-id")) == 1
    assert len(echoed.headers.get_list("date")) == 1


def test_body_over_the_cap_is_413_and_not_forwarded_whole(make_proxy: Callable[..., Proxy], keys: Keys,
                                                          echo: Echo) -> None:
    proxy = make_proxy(max_body_bytes=64 * 1024)
    with proxy.client(keys.token()) as client:
        declared = client.post("/sessions/s1/files", content=b"x" * (64 * 1024 + 1))
        streamed = client.post("/sessions/s1/files", content=iter([b"y" * 32768] * 4))
        create = client.post("/sessions", content=b"{" + b" " * (70 * 1024) + b"}")
    for response in (declared, streamed, create):
        assert response.status_code == 413, response.text
        assert response.json()["reason"] == "payload_too_large"
    assert all(len(seen.body) <= 64 * 1024 for seen in echo.seen)
    assert not any(seen.path == "/sessions" for seen in echo.seen)


def test_scheduler_unreachable_is_503_with_a_reason(make_proxy: Callable[..., Proxy], keys: Keys) -> None:
    proxy = make_proxy(scheduler_url=f"http://127.0.0.1:{free_port()}")
    with proxy.client(keys.token()) as client:
        response = client.post("/sessions", json={})
        ready = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["reason"] == "scheduler_unavailable"
    assert "Retry-After" in response.headers
    assert ready.status_code == 503 and ready.json() == {"status": "unavailable", "redis": True, "scheduler": False}


def test_redis_down_fails_closed(make_proxy: Callable[..., Proxy], keys: Keys, echo: Echo) -> None:
    proxy = make_proxy(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_seconds=0.5)
    with proxy.client(keys.token()) as client:
        response = client.post("/sessions", json={})
        metrics = client.get("/metrics").text
    assert response.status_code == 503 and response.json()["reason"] == "redis_unavailable"
    assert echo.seen == []
    assert 'sandpool_redis_errors_total{service="proxy"} 1.0' in metrics


def test_health_readiness_and_metrics(proxy: Proxy, keys: Keys) -> None:
    with proxy.client(keys.token()) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/readyz").json() == {"status": "ok", "redis": True, "scheduler": True}
        client.post("/sessions", json={})
        client.get("/nope")
        metrics = client.get("/metrics").text
    assert 'sandpool_requests_total{operation="CreateSession",service="proxy",status="201"} 1.0' in metrics
    assert 'sandpool_requests_total{operation="other",service="proxy",status="404"} 1.0' in metrics
    assert 'sandpool_request_duration_seconds_count{operation="CreateSession",service="proxy"} 1.0' in metrics


def test_unix_socket_scheduler(make_proxy: Callable[..., Proxy], keys: Keys, tmp_path: os.PathLike[str]) -> None:
    from .conftest import Seen, echo_app

    seen: list[Seen] = []
    sock = f"{tmp_path}/sched.sock"
    server = ThreadServer(echo_app(seen), uds=sock, log_config=None, access_log=False).start()
    try:
        proxy = make_proxy(scheduler_url=f"unix://{sock}")
        with proxy.client(keys.token()) as client:
            assert client.post("/sessions", json={}).status_code == 201
        assert seen[0].header("x-sandpool-workspace") == ["acme"]
    finally:
        server.stop(10)


def test_request_id_generated_when_absent_or_unsafe(proxy: Proxy, keys: Keys, echo: Echo) -> None:
    with proxy.client(keys.token()) as client:
        generated = client.post("/sessions", json={})
        unsafe = client.post("/sessions", json={}, headers={"X-Request-Id": "a b\tc" + "x" * 200})
    for response, seen in zip((generated, unsafe), echo.seen, strict=True):
        rid = response.headers["x-request-id"]
        assert len(rid) == 32 and seen.header("x-request-id") == [rid]




def test_a_cookie_one_tenant_receives_never_rides_on_another_tenants_call(proxy: Proxy, keys: Keys,
                                                                         echo: Echo) -> None:
    with proxy.client(keys.token("acme")) as first:
        answer = first.post("/sessions/s1/exec?cookie=1", json={})
    assert answer.headers["set-cookie"].startswith("sid=")  # relayed to its own client
    with httpx.Client(base_url=proxy.url, headers={"Authorization": f"Bearer {keys.token('globex')}"}) as second:
        second.post("/sessions/s2/exec", json={})
    assert echo.seen[-1].header("cookie") == []


def test_log_lines_carry_the_request_id_and_never_the_token(proxy: Proxy, keys: Keys) -> None:
    import io
    import logging

    from sandpool.core.logs import JsonFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("proxy"))
    logger = logging.getLogger("sandpool")  # the proxy's own lines and the access lines
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    token = keys.token(now=0, ttl_seconds=60)  # long expired
    try:
        with proxy.client() as client:
            client.post("/sessions", json={}, headers={"Authorization": f"Bearer {token}", "X-Request-Id": "rid-7"})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    refused = [line for line in lines if line["msg"] == "credential refused"]
    assert refused and refused[0]["request_id"] == "rid-7" and refused[0]["reason"] == "expired"
    access = [line for line in lines if line["msg"] == "request"]
    assert access and access[0]["status"] == 401 and access[0]["operation"] == "CreateSession"
    assert access[0]["request_id"] == "rid-7" and access[0]["path"] == "/sessions"
    assert token.split(".")[1] not in stream.getvalue() and token.split(".")[2] not in stream.getvalue()


def test_a_client_leaving_mid_upload_is_dropped_quietly(proxy: Proxy, keys: Keys, echo: Echo,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    import socket

    head = (f"POST /sessions/s1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {keys.token()}\r\n"
            "Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", proxy.server.port)) as raw:
        raw.sendall(head + b"x" * 1000)
        time.sleep(0.2)  # let the proxy start the forward before the client vanishes
    with proxy.client(keys.token()) as client:
        wait_for(lambda: client.get("/healthz").status_code == 200, timeout=10, what="the proxy healthy")
        assert client.post("/sessions", json={}).status_code == 201
    assert not any(len(seen.body) == 100000 for seen in echo.seen)  # never relayed as a whole body
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(("uvicorn", "sandpool"))]


def test_a_streamed_execute_keeps_its_headers_and_cancel_is_forwarded(proxy: Proxy, keys: Keys, echo: Echo) -> None:
    """`Accept` and `Sandpool-Cancel-On-Disconnect` reach the scheduler (a streamed Execute, docs/api.md);
    CancelExecution is forwarded like any session call."""
    with proxy.client(keys.token("acme")) as client:
        sent = client.post("/sessions/s1/exec", json={"tool": "code_execution", "input": {"code": "1"}},
                           headers={"Accept": "text/event-stream", "Sandpool-Cancel-On-Disconnect": "true"})
        assert sent.status_code == 200
        assert client.delete("/sessions/s1/exec").status_code == 200  # (the echo's answer, relayed)
    streamed, cancel = echo.seen
    assert streamed.header("accept") == ["text/event-stream"]
    assert streamed.header("sandpool-cancel-on-disconnect") == ["true"]
    assert (cancel.method, cancel.path) == ("DELETE", "/sessions/s1/exec")
    assert cancel.header("x-sandpool-workspace") == ["acme"]
