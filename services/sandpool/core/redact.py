"""Credentials out of anything printed: a URL's password (and user) become `***`."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact_url(url: str) -> str:
    """`redis://:secret@host:6379/0` -> `redis://:***@host:6379/0`; other text is returned as is."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = "***" if parts.username else ""
    credentials = f"{user}:***" if parts.password is not None else user
    return urlunsplit(parts._replace(netloc=f"{credentials}@{host}"))
