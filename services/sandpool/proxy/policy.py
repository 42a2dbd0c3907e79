"""Workspace policy: what an admin stored, bounded by the operator's ceilings.

A stored policy may only lower a ceiling: a PUT with a value above one is
refused (422) rather than clamped, so the admin learns at once. A field left
unset inherits the ceiling. 0 in a ceiling means "no ceiling here"; the values
in force are forwarded to the scheduler in the `X-Sandpool-*` headers, which it
enforces atomically at lease (absent header = no limit beyond its own ceilings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandpool.contract import tenancy
from sandpool.proxy.settings import ProxySettings

Limit = Annotated[int, Field(ge=1, le=10**12)] | None
MAX_IMAGES = 256


class Policy(BaseModel):
    """A workspace's policy. Unset (null) fields inherit the operator's ceiling."""

    model_config = ConfigDict(extra="forbid")

    allowed_images: list[Annotated[str, Field(min_length=1, max_length=512)]] | None = Field(
        default=None, max_length=MAX_IMAGES,
        description="Images a CreateSession may name (null: any; a request naming none gets the default pool)")
    max_concurrent_sessions: Limit = Field(default=None, description="Live sessions at once")
    max_idle_timeout_seconds: Limit = Field(default=None, description="Ceiling of a session's idle timeout")
    max_lifetime_seconds: Limit = Field(default=None, description="Ceiling of a session's lifetime")
    max_exec_timeout_seconds: Limit = Field(default=None, description="Ceiling of one execution's timeout")
    daily_session_seconds_budget: Limit = Field(default=None,
                                                description="Session-seconds per UTC day (enforced at lease)")
    requests_per_minute: Limit = Field(default=None, description="Requests per UTC minute, across all proxies")


LIMIT_FIELDS = ("max_concurrent_sessions", "max_idle_timeout_seconds", "max_lifetime_seconds",
                "max_exec_timeout_seconds", "daily_session_seconds_budget", "requests_per_minute")

HEADER_OF = {
    "max_concurrent_sessions": tenancy.MAX_CONCURRENT_SESSIONS,
    "max_idle_timeout_seconds": tenancy.MAX_IDLE_TIMEOUT,
    "max_lifetime_seconds": tenancy.MAX_LIFETIME,
    "max_exec_timeout_seconds": tenancy.MAX_EXEC_TIMEOUT,
    "daily_session_seconds_budget": tenancy.DAILY_SESSION_SECONDS_BUDGET,
}


def ceilings_of(settings: ProxySettings) -> dict[str, int]:
    return {name: getattr(settings, f"ceiling_{name}") for name in LIMIT_FIELDS}


def above_ceilings(policy: Policy, ceilings: dict[str, int]) -> list[str]:
    """Human-readable violations: each field whose value exceeds a (non-zero) ceiling."""
    return [f"{name}={getattr(policy, name)} is above the operator's ceiling {ceilings[name]}"
            for name in LIMIT_FIELDS
            if ceilings[name] and getattr(policy, name) is not None and getattr(policy, name) > ceilings[name]]


@dataclass(frozen=True)
class Effective:
    """The values in force for one workspace (0 = no limit), with the headers the scheduler reads."""

    allowed_images: frozenset[str] | None
    limits: dict[str, int]
    headers: tuple[tuple[str, str], ...]

    @property
    def requests_per_minute(self) -> int:
        return self.limits["requests_per_minute"]


def effective(policy: Policy, ceilings: dict[str, int]) -> Effective:
    limits = {}
    for name in LIMIT_FIELDS:
        value, ceiling = getattr(policy, name), ceilings[name]
        # A stored value may predate a lowered ceiling: the ceiling still wins.
        limits[name] = min(value, ceiling) if value and ceiling else (value or ceiling)
    headers = tuple((HEADER_OF[n], str(limits[n])) for n in HEADER_OF if limits[n])
    images = frozenset(policy.allowed_images) if policy.allowed_images is not None else None
    return Effective(allowed_images=images, limits=limits, headers=headers)


class PolicyCodec:
    """Stored JSON → effective values, memoised on the exact stored text (a Redis GET per request is
    exact; re-parsing the same JSON each time is the part worth skipping)."""

    def __init__(self, ceilings: dict[str, int]) -> None:
        self.ceilings = ceilings
        self.default = effective(Policy(), ceilings)
        self._decode = lru_cache(maxsize=4096)(self._decode_uncached)

    def _decode_uncached(self, raw: str) -> Effective:
        return effective(load_policy(raw), self.ceilings)

    def decode(self, raw: str | None) -> Effective:
        return self._decode(raw) if raw else self.default


class CorruptPolicy(ValueError):
    """The stored record does not parse: the workspace is refused (fail closed), never unlimited."""


def load_policy(raw: str | bytes | None) -> Policy:
    if not raw:
        return Policy()
    try:
        return Policy.model_validate(json.loads(raw))
    except (ValueError, ValidationError):
        raise CorruptPolicy("the workspace's stored policy is unreadable") from None


def dump_policy(policy: Policy) -> str:
    return policy.model_dump_json()
