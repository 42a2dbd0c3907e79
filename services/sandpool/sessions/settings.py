"""The session layer's settings: ceilings, defaults, capacity and forwarding.

Operator values here are *ceilings*: a workspace policy (handed over by the
edge) or a request hint may lower them, never raise them.
"""

from __future__ import annotations

from pydantic import Field

from sandpool.controller.pools import PoolSettings
from sandpool.state.settings import RedisSettings


class SessionSettings(RedisSettings, PoolSettings):
    # --- session ceilings and defaults -----------------------------------------------------
    default_idle_timeout_seconds: int = Field(default=300, ge=1, description="Idle timeout when none is asked")
    max_idle_timeout_seconds: int = Field(default=3600, ge=1, description="Ceiling of the idle timeout")
    default_lifetime_seconds: int = Field(default=3600, ge=1, description="Max lifetime when none is asked")
    max_lifetime_seconds: int = Field(default=86400, ge=1, description="Ceiling of the max lifetime")
    default_exec_timeout_seconds: int = Field(default=60, ge=1, description="Exec timeout when none is asked")
    max_exec_timeout_seconds: int = Field(default=300, ge=1, description="Ceiling of the exec timeout")
    workspace_max_concurrent_sessions: int = Field(default=0, ge=0, description=(
        "Most live sessions one workspace may hold; a workspace policy may lower it (0: none)"))
    workspace_daily_session_seconds_budget: int = Field(default=0, ge=0, description=(
        "Session-seconds one workspace may use per UTC day; a workspace policy may lower it (0: none)"))

    # --- capacity and forwarding -------------------------------------------------------------
    capacity_wait_seconds: float = Field(default=30.0, ge=0, le=600, description=(
        "How long CreateSession waits for a sandbox when none is ready: below the ceiling, for one started "
        "for it; at the ceiling, for a slot a release frees, when the pool's releases of the last minute say "
        "one comes within half this wait (0: fail fast with 503 at once)"))
    answer_grace_seconds: float = Field(default=10.0, ge=0, description=(
        "How long after its lease a session whose CreateSession answer was never confirmed sent (the api "
        "died first) keeps its sandbox before the reaper releases it (0: until its idle timeout, and no "
        "confirmation is sent)"))
    retry_after_seconds: int = Field(default=1, ge=1, description=(
        "Retry-After of a 503 other than a capacity refusal (whose Retry-After follows the pool's release rate)"))
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description=(
        "Largest request body (an upload, an exec call) forwarded to a sandbox; larger is 413"))
    forward_connect_timeout_seconds: float = Field(default=2.0, gt=0, description=(
        "Timeout connecting to a sandbox's agent"))
    forward_timeout_seconds: float = Field(default=60.0, gt=0, description=(
        "Timeout of a file call to a sandbox's agent"))
    exec_grace_seconds: float = Field(default=10.0, ge=0, description=(
        "Time beyond an exec's timeout the agent has to answer before the call counts as failed"))
    call_record_grace_seconds: float = Field(default=30.0, ge=0, description=(
        "How long past a call's longest run its record waits for the call's done before the controller "
        "settles it as an unconfirmed call (the api that ran it crashed)"))
    agent_clients_max: int = Field(default=1024, ge=1, description=(
        "Sandbox agents whose HTTP connection pools are kept open at once"))
