"""Bearer-secret check in front of every route but the health check.

Pure ASGI, so a refused request costs no body read and no routing. The secret
is compared in constant time; a missing and a wrong secret get the same answer.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from sandpool.core.errors import Unauthorized, error_response

OPEN_PATHS = frozenset({"/healthz"})


class BearerSecretMiddleware:
    def __init__(self, app: ASGIApp, *, secret: str) -> None:
        self.app = app
        self._expected = ("Bearer " + secret).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["path"] in OPEN_PATHS and scope["method"] in ("GET", "HEAD")):
            await self.app(scope, receive, send)
            return
        presented = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                presented = value
                break
        if not hmac.compare_digest(presented, self._expected):
            await error_response(Unauthorized("missing or wrong agent secret"))(scope, receive, send)
            return
        await self.app(scope, receive, send)
