"""The client's configuration, checked once when a client is built."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from sandpool import __version__
from sandpool.client.calls import Timeouts
from sandpool.client.retry import RetryPolicy

URL_ENV = "SANDPOOL_URL"
TOKEN_ENV = "SANDPOOL_TOKEN"


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    headers: dict[str, str] = field(repr=False)
    timeouts: Timeouts
    retry: RetryPolicy

    @classmethod
    def build(cls, base_url: str, token: str | None, *, timeout: float, max_retries: int, max_retry_wait: float,
              exec_timeout_margin: float, default_exec_timeout: float,
              headers: Mapping[str, str] | None) -> ClientConfig:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if parts.query or parts.fragment:
            raise ValueError("base_url must not carry a query or fragment")
        if timeout <= 0 or exec_timeout_margin < 0 or default_exec_timeout <= 0:
            raise ValueError("timeouts must be positive")
        merged = {"User-Agent": f"sandpool-client/{__version__}", **(headers or {})}
        if token:
            if any(c in token for c in "\r\n"):
                raise ValueError("token must be a single line")
            merged["Authorization"] = f"Bearer {token.strip()}"
        return cls(
            base_url=base_url.rstrip("/"),
            headers=merged,
            timeouts=Timeouts(request=timeout, exec_margin=exec_timeout_margin, exec_default=default_exec_timeout),
            retry=RetryPolicy(max_retries=max_retries, max_total_wait=max_retry_wait),
        )

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
        env = os.environ if environ is None else environ
        url = env.get(URL_ENV, "").strip()
        if not url:
            raise ValueError(f"{URL_ENV} is not set (sandpool up prints it)")
        return url, (env.get(TOKEN_ENV) or "").strip() or None

    def url(self, path: str) -> str:
        return self.base_url + path


__all__ = ["TOKEN_ENV", "URL_ENV", "ClientConfig"]
