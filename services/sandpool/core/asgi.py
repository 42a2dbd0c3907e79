"""Small ASGI facts the services share."""

from __future__ import annotations

from starlette.requests import Request


async def client_gone(request: Request) -> None:
    """Return once the client has disconnected. Only for a request whose body was read already:
    from then on the server's `receive` answers nothing but the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
