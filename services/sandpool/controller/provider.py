"""The narrow interface between the pool controller and whatever runs sandboxes.

The controller sees only this: no Kubernetes type, no local
process handle leaks past it. A provider creates a sandbox and returns where its
agent listens (`http://host:port` or `unix:///path`) and the agent's
per-sandbox secret; it lists what it runs (for reconciliation after a restart)
and destroys sandboxes with everything they started.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SANDBOX_ID_LENGTH = 23
"""Length of every id `new_sandbox_id` makes (providers size paths and names by it)."""


def new_sandbox_id() -> str:
    """Unguessable, and valid as a directory name and a Kubernetes object name."""
    return "sb-" + secrets.token_hex(10)


@dataclass(frozen=True)
class PoolSpec:
    """One pool: a kind of sandbox kept warm. Providers read the fields they understand."""

    name: str
    image: str
    warm: int = 2
    """The warm floor: sandboxes kept ready whatever the demand."""
    ceiling: int = 16
    """Most sandboxes of the pool at once, whatever their state."""
    max_warm: int | None = None
    """The warm cap: the most kept ready when demand asks for more than the floor (None: the floor)."""
    cpu: str | None = None
    """Limit: CPU of one sandbox (a quantity such as 500m)."""
    memory: str | None = None
    """Limit: memory of one sandbox (a quantity such as 1Gi)."""
    cpu_request: str | None = None
    """What the Kubernetes scheduler should reserve for one sandbox (None: the limit, or nothing)."""
    memory_request: str | None = None
    runtime_class: str | None = None
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    """Provider name -> that provider's pool options (`providers.registry`), typed and already
    validated; a provider with none here uses its defaults."""

    @property
    def warm_cap(self) -> int:
        return max(self.warm, min(self.ceiling, self.max_warm if self.max_warm is not None else self.warm))


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox the provider runs. `ready` means its agent answered its health check."""

    sandbox_id: str
    pool: str
    address: str | None = None
    secret: str | None = None
    ready: bool = False
    egress_digest: str | None = None
    """`state.keys.egress_digest` of the sandbox's egress credential (None: it has no egress): published
    with the sandbox, bound to its session by the lease. The credential itself stays with the sandbox."""


LostListener = Callable[[str, str], None]
"""Told that a sandbox died on its own: called with its sandbox id and a short reason.

Reasons: `deleted` (its pod or process was removed by someone else), `failed` (it
exited or its pod failed), `not_running` (its pod left the Running phase or lost
its address). Called on the event loop as soon as the provider learns it; it must
not block. Never called for a sandbox the provider is creating (the create fails
instead) or destroying on request.
"""

LOSS_REASONS = ("deleted", "failed", "not_running")


class ProviderError(Exception):
    """The provider could not do what was asked; `transient` ones are worth retrying later."""

    def __init__(self, message: str, *, transient: bool = True) -> None:
        super().__init__(message)
        self.transient = transient


@runtime_checkable
class Provider(Protocol):
    name: str

    async def start(self) -> None:
        """Prepare (connect, detect isolation, start templates). Called once by the owner."""

    async def close(self) -> None:
        """Release the provider's own resources. Does not destroy sandboxes."""

    async def create(self, pool: PoolSpec, sandbox_id: str) -> SandboxInfo:
        """Create a sandbox and return once its agent answers its health check."""

    async def destroy(self, sandbox_id: str) -> None:
        """Destroy the sandbox and every process and file it made. Idempotent."""

    async def list(self) -> list[SandboxInfo]:
        """Every sandbox this installation's provider runs, ready or not."""

    def describe(self) -> dict[str, object]:
        """What the provider is and what isolation is in force, for logs and /readyz."""

    def on_lost(self, listener: LostListener) -> None:
        """Optional: register the one listener told at once when a sandbox dies on its own.

        The owner calls it once, after `start()`. A provider that cannot tell accepts the
        listener and never calls it; reconciliation (`list`) still finds the loss later.
        """
