"""GET /v1/sessions writes its list in pieces (the event loop free between them): the pieces together are
byte for byte what the declared `SessionList` model writes, for no session, one, and several pieces' worth."""

from __future__ import annotations

import asyncio

import pytest

from sandpool.contract.models import SessionDetails
from sandpool.edge.admin import LIST_CHUNK, SessionList, _session_details, _session_list_json


def handle(n: int) -> dict[str, object]:
    return {"session_id": f"s-{n:04d}", "pool": "default", "image": "python", "created_at": 100.25 + n,
            "last_activity_at": 101.5, "idle_timeout_seconds": 600, "max_lifetime_seconds": 3600,
            "exec_timeout_seconds": 30, "max_exec_timeout_seconds": 60, "limits": {"max_processes": 64},
            "deadline": 700.0 + n}


async def collect(workspace: str, sessions: list[dict[str, object]]) -> bytes:
    details = await _session_details(workspace, sessions)
    return b"".join([piece async for piece in _session_list_json(workspace, details)])


@pytest.mark.parametrize("count", [0, 1, LIST_CHUNK, LIST_CHUNK * 2 + 3])
def test_the_pieces_are_the_models_json(count: int) -> None:
    sessions = [handle(n) for n in range(count)]
    expected = SessionList(workspace='w "quoted"',
                           sessions=[SessionDetails(workspace='w "quoted"', **s) for s in sessions]).model_dump_json()
    assert asyncio.run(collect('w "quoted"', sessions)) == expected.encode()


def test_a_handle_the_model_refuses_fails_before_anything_is_sent() -> None:
    sessions = [handle(n) for n in range(LIST_CHUNK + 5)]
    sessions[LIST_CHUNK + 2]["idle_timeout_seconds"] = 1.5  # not an integer: the model refuses it
    with pytest.raises(ValueError):
        asyncio.run(_session_details("w", sessions))
