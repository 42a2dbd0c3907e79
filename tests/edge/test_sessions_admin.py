"""Sessions seen and ended through the real api (the edge over the session layer): the handle (GET), the admin
kill switch, destroy never refused by a limit, and a limit added to the catalogue reaching the lease on its own."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator

import pytest
from testkit import wait_for

from sandpool.client import Client
from sandpool.client.errors import QuotaExceeded
from sandpool.contract import limits as catalogue

from .stack import PRINT_1, Stack


def test_get_session_returns_the_handle_and_a_foreign_or_unknown_id_the_same_404(stack: Stack) -> None:
    stack.sandboxes.publish_agents(1)
    with stack.client("acme") as acme, stack.client("globex") as globex:
        created = acme.post("/sessions", json={"idle_timeout_seconds": 120}).json()
        sid = created["session_id"]
        before = acme.get(f"/sessions/{sid}")
        assert before.status_code == 200, before.text
        handle = before.json()
        assert handle["session_id"] == sid and handle["workspace"] == "acme"
        assert handle["idle_timeout_seconds"] == 120 == created["idle_timeout_seconds"]
        assert handle["max_lifetime_seconds"] == created["max_lifetime_seconds"]
        assert handle["created_at"] == pytest.approx(created["created_at"], abs=0.01)
        assert handle["image"] == created["image"] and handle["deadline"] > time.time()
        assert "secret" not in before.text and "address" not in before.text and "unix://" not in before.text
        # Reading the handle is not activity; a call is.
        assert acme.get(f"/sessions/{sid}").json()["last_activity_at"] == handle["last_activity_at"]
        assert acme.post(f"/sessions/{sid}/exec", json=PRINT_1).status_code == 200
        # (The call's `done`, which marks the session active, runs just after its answer is sent.)
        wait_for(lambda: acme.get(f"/sessions/{sid}").json()["last_activity_at"] > handle["last_activity_at"],
                 timeout=10, what="the call marking the session active")
        foreign, unknown = globex.get(f"/sessions/{sid}"), acme.get("/sessions/no-such-session")
        assert foreign.status_code == unknown.status_code == 404
        assert foreign.json() == unknown.json()
        assert acme.delete(f"/sessions/{sid}").status_code == 204
        assert acme.get(f"/sessions/{sid}").status_code == 404


def test_an_admin_ends_any_workspace_session_and_nobody_else_can(stack: Stack, caplog: pytest.LogCaptureFixture
                                                                 ) -> None:
    stack.sandboxes.publish_agents(1)
    with stack.client("acme") as acme, stack.client("ops", admin=True) as admin, \
            stack.client("globex") as globex:
        sid = acme.post("/sessions", json={}).json()["session_id"]
        assert globex.delete(f"/v1/sessions/{sid}").status_code == 403
        assert acme.delete(f"/v1/sessions/{sid}").status_code == 403  # its own, but not an admin
        assert acme.post(f"/sessions/{sid}/exec", json=PRINT_1).status_code == 200
        with caplog.at_level(logging.INFO, logger="sandpool.edge.admin"):
            ended = admin.delete(f"/v1/sessions/{sid}")
        assert ended.status_code == 200, ended.text
        body = ended.json()
        assert (body["session_id"], body["workspace"], body["reason"]) == (sid, "acme", "admin")
        assert body["session_seconds"] >= 0
        assert acme.post(f"/sessions/{sid}/exec", json=PRINT_1).status_code == 404
        again = admin.delete(f"/v1/sessions/{sid}")
        assert again.status_code == 404 and again.json()["reason"] == "not_found"
        assert admin.delete("/v1/sessions/..%2Fetc").status_code in (404, 422)
        # The contract's DELETE keeps v1's answer for every token: a foreign id is 204, untouched.
        other = acme.post("/sessions", json={})
        assert other.status_code == 201 or stack.ready() == 0
    [line] = [r for r in caplog.records if r.getMessage() == "session ended by an admin"]
    assert (line.admin, line.workspace, line.session) == ("workspace:ops", "acme", sid)  # type: ignore[attr-defined]  # the record's `extra` fields
    released = [e for _, e in stack.rdb.xrange(stack.rkeys.usage_events) if e.get("session") == sid
                and e["type"] == "session_released"]
    assert [e["reason"] for e in released] == ["admin"]


def test_destroy_is_never_refused_by_the_rate_limit(stack: Stack) -> None:
    stack.sandboxes.publish_agents(1)
    with stack.client("ops", admin=True) as admin:
        assert admin.put("/v1/workspaces/acme/policy", json={"requests_per_minute": 3}).status_code == 200
    token = stack.keys.token("acme")
    with Client(stack.api.url, token=token, max_retries=0) as client:
        with client.session() as session:  # request 1
            assert session.run_python("print(1)").stdout == "1\n"  # 2
            assert session.run_python("print(2)").stdout == "2\n"  # 3: the minute's last
            with pytest.raises(QuotaExceeded) as limited:
                session.run_python("print(3)")
            assert limited.value.limit == "requests_per_minute"
            sid = session.id
        # Leaving the block destroyed the session although the workspace is at its rate limit.
    with stack.client("acme") as acme:
        gone = acme.post(f"/sessions/{sid}/exec", json=PRINT_1)
    assert gone.status_code == 429  # still limited: the destroys above were neither refused nor counted
    assert stack.rdb.exists(stack.rkeys.session(sid)) == 0
    assert stack.ready() == 0 and stack.rdb.sismember(stack.rkeys.doomed, _sandbox_of(stack, sid))


def _sandbox_of(stack: Stack, sid: str) -> str:
    for _, event in stack.rdb.xrange(stack.rkeys.usage_events):
        if event.get("session") == sid and event["type"] == "session_created":
            return event["sandbox"]
    raise AssertionError(f"no session_created event for {sid}")


@pytest.fixture
def dummy_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[catalogue.Limit]:
    """One more lease limit in the catalogue, and nothing else changed anywhere."""
    limit = catalogue.Limit("max_dummy_things", "A limit no module knows by name", "lease",
                            ceiling="workspace_max_dummy_things")
    monkeypatch.setattr(catalogue, "LIMITS", (*catalogue.LIMITS, limit))
    yield limit


def test_a_limit_added_to_the_catalogue_reaches_the_lease_with_no_other_change(
        dummy_limit: catalogue.Limit, stack_factory: Callable[[], Stack]) -> None:
    stack = stack_factory()  # built after the catalogue grew
    stack.sandboxes.publish_agents(1)
    with stack.client("ops", admin=True) as admin:
        put = admin.put("/v1/workspaces/acme/policy", json={dummy_limit.name: 7})
        assert put.status_code == 200, put.text
        assert put.json()["effective"]["limits"][dummy_limit.name] == 7
    with stack.client("acme") as acme:
        sid = acme.post("/sessions", json={}).json()["session_id"]
        handle = acme.get(f"/sessions/{sid}").json()
    assert handle["limits"][dummy_limit.name] == 7
    assert json.loads(stack.rdb.hget(stack.rkeys.session(sid), "limits"))[dummy_limit.name] == 7
