"""The admin API from Python: usage, sessions, policies, revocation, ending a session.

    with AdminClient.from_env() as admin:              # SANDPOOL_URL, SANDPOOL_TOKEN (an admin token)
        print(admin.usage(workspace="acme")["total"]["executions"])
        admin.set_policy("acme", max_concurrent_sessions=5)
        admin.end_session("...")

Every method returns the API's JSON as it is (documented in docs/api.md) and raises
the client's named errors (`Unauthorized`, `Forbidden`, `NotFound`, `ConnectionFailed`...).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx

from sandpool.client.calls import Call, Retry
from sandpool.client.config import ClientConfig
from sandpool.client.errors import SandpoolClientError
from sandpool.client.transport import error_for_transport, read_response

MAX_TOKEN_LIFETIME_SECONDS = 366 * 86400
"""How long a revocation by bare jti is kept: longer than any token `sandpool token` mints lives."""


def _json(response: httpx.Response) -> Any:
    return response.json()


class AdminClient:
    def __init__(self, base_url: str, token: str | None, *, timeout: float = 30.0,
                 http_client: httpx.Client | None = None) -> None:
        self.config = ClientConfig.build(base_url, token, timeout=timeout, max_retries=0, max_retry_wait=0,
                                         exec_timeout_margin=0, default_exec_timeout=1, headers=None)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> AdminClient:
        base_url, token = ClientConfig.from_env(environ)
        return cls(base_url, token, **kwargs)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, *, expect: tuple[int, ...] = (200,), params: dict[str, Any] | None = None,
              json: Any = None) -> Any:
        call = Call(operation=f"admin {method} {path}", method=method, path=path, expect=expect, retry=Retry.ONCE,
                    timeout=self.config.timeouts.plain(), parse=_json)
        try:
            response = self._http.request(method, self.config.url(path), headers=self.config.headers,
                                          params={k: v for k, v in (params or {}).items() if v is not None},
                                          json=json, timeout=call.timeout)
        except httpx.TransportError as exc:
            raise error_for_transport(call, exc) from None
        value, error = read_response(call, response)
        if error is not None:
            raise error
        return value

    # --- reads (a workspace token reads its own; an admin token any) ----------------------------

    def usage(self, *, workspace: str | None = None, start: str | None = None, end: str | None = None) -> Any:
        return self._call("GET", "/v1/usage", params={"workspace": workspace, "from": start, "to": end})

    def sessions(self, *, workspace: str | None = None, limit: int | None = None) -> Any:
        return self._call("GET", "/v1/sessions", params={"workspace": workspace, "limit": limit})

    # --- admin only -------------------------------------------------------------------------

    def policy(self, workspace: str) -> Any:
        return self._call("GET", f"/v1/workspaces/{quote(workspace, safe='')}/policy")

    def set_policy(self, workspace: str, **values: Any) -> Any:
        """Replace the workspace's policy with `values` (fields left out inherit the ceilings)."""
        return self._call("PUT", f"/v1/workspaces/{quote(workspace, safe='')}/policy", json=values)

    def update_policy(self, workspace: str, **changes: Any) -> Any:
        """Change some fields of the stored policy, keeping the others."""
        stored = dict(self.policy(workspace)["policy"])
        stored.update(changes)
        return self.set_policy(workspace, **stored)

    def revoke(self, jti: str, *, expires_at: float | None = None) -> Any:
        """Revoke a token by its jti, until its `expires_at` (or the longest a token can live)."""
        if expires_at is not None:
            return self._call("POST", "/v1/revocations", expect=(201,), json={"jti": jti, "exp": int(expires_at)})
        return self._call("POST", "/v1/revocations", expect=(201,),
                          json={"jti": jti, "ttl": MAX_TOKEN_LIFETIME_SECONDS})

    def end_session(self, session_id: str) -> Any:
        """End any workspace's session (the kill switch); `NotFound` when there is no such session."""
        return self._call("DELETE", f"/v1/sessions/{quote(session_id, safe='')}")


def token_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (the server verifies; this only reads `jti` and `exp`)."""
    import base64
    import json

    parts = token.split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT")
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (ValueError, TypeError):
        raise ValueError("not a JWT") from None
    if not isinstance(claims, dict):
        raise ValueError("not a JWT")
    return claims


def expired(claims: Mapping[str, Any]) -> bool:
    exp = claims.get("exp")
    return isinstance(exp, (int, float)) and exp < time.time()


__all__ = ["AdminClient", "SandpoolClientError", "token_claims"]
