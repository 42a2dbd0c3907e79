"""Request-body caps: 413 on a declared Content-Length over the cap, and on a
streamed body (chunked, or lying about its length) as soon as it passes it.

The upload route gets the upload cap plus room for the multipart framing; every
other route gets the request cap. The handlers read bodies through the wrapped
`receive`, so a body is never held whole beyond its cap.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandpool.core.errors import PayloadTooLarge, error_response

MULTIPART_OVERHEAD = 64 * 1024


class BodyTooLarge(PayloadTooLarge):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_request_bytes: int, max_upload_bytes: int) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.max_upload_bytes = max_upload_bytes

    def cap_for(self, scope: Scope) -> int:
        if scope["method"] == "POST" and scope["path"].endswith("/files"):
            return self.max_upload_bytes + MULTIPART_OVERHEAD
        return self.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.cap_for(scope)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > cap:
                    await error_response(BodyTooLarge(f"request body over the {cap}-byte cap"))(
                        scope, receive, send)
                    return
                break
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    raise BodyTooLarge(f"request body over the {cap}-byte cap")
            return message

        await self.app(scope, counted, send)
