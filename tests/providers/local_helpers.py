"""Helpers for the local provider tests: talk to an agent over its socket."""

from __future__ import annotations

import httpx


def agent_client(address: str, secret: str | None = None) -> httpx.AsyncClient:
    assert address.startswith("unix://")
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=address[len("unix://"):]),
                             base_url="http://sandbox", headers=headers, timeout=30)


async def run(address: str, secret: str, tool: str, **tool_input: str) -> dict:
    async with agent_client(address, secret) as client:
        response = await client.post("/sessions/s/exec", json={"tool": tool, "input": tool_input})
        assert response.status_code == 200, response.text
        return response.json()


def output(result: dict) -> tuple[str, str, int]:
    """(stdout, stderr, return_code) of an exec result block."""
    block = result["result_block"]["content"]
    return block.get("stdout", ""), block.get("stderr", ""), block.get("return_code", 0)
