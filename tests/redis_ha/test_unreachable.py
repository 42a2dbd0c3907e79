"""A Redis that cannot be reached, in any `--redis-url` form, is the one failure the services know
how to wait out (`StateUnavailable`: a 503, a start that carries on), never another exception, and
its password is never shown."""

from __future__ import annotations

import asyncio

import pytest
from testkit import free_port

from sandpool.state.client import close, connect, ping_sync
from sandpool.state.errors import StateUnavailable
from sandpool.state.keys import Keys
from sandpool.state.sessions import SessionStore


def _urls() -> list[str]:
    return [f"redis://:hunter2@127.0.0.1:{free_port()}/0",
            f"redis+sentinel://:hunter2@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/primary/0",
            f"redis+cluster://:hunter2@127.0.0.1:{free_port()},127.0.0.1:{free_port()}"]


@pytest.mark.parametrize("url", _urls(), ids=["server", "sentinel", "cluster"])
def test_nothing_listening_is_state_unavailable(url: str) -> None:
    with pytest.raises(StateUnavailable) as refused:
        ping_sync(url, timeout=0.5)
    assert "hunter2" not in str(refused.value) and "does not answer" in str(refused.value)

    async def through_a_store() -> None:
        client = connect(url, timeout=0.5)
        try:
            store = SessionStore(client, Keys("unreachable"))
            with pytest.raises(StateUnavailable):
                await store.load_scripts()
            with pytest.raises(StateUnavailable):
                await store.handle("some-session", workspace=None)
        finally:
            await close(client)

    asyncio.run(through_a_store())
