"""How many sandboxes a pool keeps warm: between its floor and its cap, following demand.

The target is what Little's law says is in the pipeline (leases per second over
the last minute, times how long a sandbox takes to start), times a headroom for
bursts, clamped between the pool's floor (`warm`) and cap (`max_warm`). It grows
at once, so a rising load finds sandboxes ready, and shrinks one sandbox per
`shrink_every` seconds, so a dip between bursts does not throw warm sandboxes
away (they are destroyed, never reused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_HEADROOM = 2.0
DEFAULT_SHRINK_EVERY_SECONDS = 10.0
START_ESTIMATE_WEIGHT = 0.2
"""Weight of the newest start time in the moving estimate (the rest is the history's)."""


@dataclass
class WarmTarget:
    floor: int
    cap: int
    headroom: float = DEFAULT_HEADROOM
    shrink_every: float = DEFAULT_SHRINK_EVERY_SECONDS
    start_seconds: float = 0.5
    """Moving estimate of how long a sandbox takes to start (seconds)."""
    lease_rate: float = 0.0
    """Leases per second over the last minute, as last observed."""
    target: int = field(init=False)
    _last_shrink: float = field(default=-math.inf, init=False)

    def __post_init__(self) -> None:
        self.cap = max(self.cap, self.floor)
        self.target = self.floor

    def observe_start(self, seconds: float) -> None:
        self.start_seconds += START_ESTIMATE_WEIGHT * (seconds - self.start_seconds)

    def wanted(self, lease_rate: float) -> int:
        """The target demand alone asks for (before the slow shrink)."""
        return max(self.floor, min(self.cap, math.ceil(lease_rate * self.start_seconds * self.headroom)))

    def update(self, lease_rate: float, now: float) -> int:
        """The target after observing `lease_rate` at monotonic time `now`."""
        self.lease_rate = lease_rate
        wanted = self.wanted(lease_rate)
        if wanted >= self.target:
            self.target = wanted
            self._last_shrink = now
        elif now - self._last_shrink >= self.shrink_every:
            self.target -= 1
            self._last_shrink = now
        return self.target
