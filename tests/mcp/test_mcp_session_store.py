"""The previous revision's MCP sessions in a real Redis: bound to their workspace, one default session each."""

from __future__ import annotations

import uuid

from sandpool.state import close, connect
from sandpool.state.keys import Keys
from sandpool.state.mcp_sessions import McpSessionStore


async def test_an_mcp_session_is_its_workspace_s_and_keeps_one_default_session(redis_url) -> None:
    client = connect(redis_url, timeout=5)
    keys = Keys("tmcps" + uuid.uuid4().hex[:8])
    store = McpSessionStore(client, keys, idle_ttl=60)
    try:
        opened = await store.open("ws-a")
        assert (await store.lookup(opened.id, "ws-a")).session == ""
        assert await store.lookup(opened.id, "ws-b") is None  # another workspace's reads as unknown
        assert await store.lookup("no-such-id", "ws-a") is None
        assert 0 < await client.ttl(keys.mcp_session(opened.id)) <= 60

        assert await store.bind(opened.id, "ws-b", "s-b") is None  # nothing of ws-a is touched by ws-b
        assert await store.bind(opened.id, "ws-a", "s-1") == "s-1"
        assert await store.bind(opened.id, "ws-a", "s-2") == "s-1"  # the first lease won: s-2 is released
        assert not await store.unbind(opened.id, "ws-a", "s-2")
        assert await store.unbind(opened.id, "ws-a", "s-1")
        assert await store.bind(opened.id, "ws-a", "s-3") == "s-3"

        await store.running(opened.id, "7", "s-3")
        assert await store.running_in(opened.id, "7") == "s-3"
        await store.finished(opened.id, "7")
        assert await store.running_in(opened.id, "7") is None

        assert await store.close(opened.id, "ws-b") is None
        closed = await store.close(opened.id, "ws-a")
        assert closed is not None and closed.session == "s-3"
        assert await store.lookup(opened.id, "ws-a") is None
        assert await client.exists(keys.mcp_session(opened.id)) == 0
    finally:
        await close(client)
