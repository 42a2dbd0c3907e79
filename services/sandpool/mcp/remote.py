"""The backend of `sandpool mcp`: the contract over HTTP, through sandpool's own Python client.

It serves any sandpool URL (auth on with a token, or `--no-auth`). Execute is streamed
with cancel-on-disconnect, so output reaches the MCP client as progress while the call
runs, and a cancelled tool call (its task cancelled) closes the stream, which stops the
call in the sandbox.
"""

from __future__ import annotations

from typing import Any

from sandpool.client import AsyncClient, SandpoolClientError
from sandpool.client.results import ExecResult
from sandpool.contract.agent_protocol import Event
from sandpool.mcp.backend import CallRefused, OnOutput, refusal


def _refused(exc: SandpoolClientError) -> CallRefused:
    body = dict(getattr(exc, "body", None) or {})
    status = getattr(exc, "status", None) or 502
    detail = getattr(exc, "detail", None)
    if isinstance(detail, (str, list)):
        body.setdefault("detail", detail)
    else:
        body.setdefault("detail", str(exc))
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        body.setdefault("reason", reason)
    retry = getattr(exc, "retry_after", None)
    return refusal(int(status), body, f"{retry:g}" if isinstance(retry, (int, float)) else None)


class ClientBackend:
    """The contract's operations through `sandpool.client.AsyncClient` (one token, one workspace)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def create_session(self) -> str:
        try:
            session = await self.client.create_session()
        except SandpoolClientError as exc:
            raise _refused(exc) from None
        return session.id

    async def execute(self, session_id: str, body: dict[str, Any], on_output: OnOutput | None) -> dict[str, Any]:
        session = self.client.attach(session_id)
        result: ExecResult | None = None
        try:
            async for event in session.stream(body["tool"], body["input"], timeout_seconds=body.get("timeout_seconds"),
                                              cancel_on_disconnect=True):
                if event.type in (Event.STDOUT, Event.STDERR) and on_output is not None:
                    await on_output(event.type, event.text)
                elif event.result is not None:
                    result = event.result
        except SandpoolClientError as exc:
            raise _refused(exc) from None
        if result is None:
            raise CallRefused(502, "the call's stream ended before its result")
        return dict(result.raw)

    async def cancel(self, session_id: str) -> None:
        try:
            await self.client.attach(session_id).cancel()
        except SandpoolClientError as exc:
            raise _refused(exc) from None

    async def put_file(self, session_id: str, path: str, data: bytes) -> dict[str, Any]:
        try:
            stored = await self.client.attach(session_id).upload(path, data)
        except SandpoolClientError as exc:
            raise _refused(exc) from None
        return dict(stored.raw) if getattr(stored, "raw", None) else {"path": path, "size_bytes": len(data)}

    async def get_file(self, session_id: str, path: str) -> bytes:
        try:
            return await self.client.attach(session_id).download(path)
        except SandpoolClientError as exc:
            raise _refused(exc) from None

    async def destroy_session(self, session_id: str) -> None:
        try:
            await self.client.destroy_session(session_id)
        except SandpoolClientError as exc:
            raise _refused(exc) from None


__all__ = ["ClientBackend"]
