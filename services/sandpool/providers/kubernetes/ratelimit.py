"""A token bucket that spaces out the provider's writes to the Kubernetes API.

A burst of creates (a pool refilling after 50 leases) must not arrive at the API
server as 50 simultaneous POSTs: API Priority and Fairness would answer 429 and
every retry would add to the pile. The bucket lets `burst` calls through at once,
then `rate` per second, first come first served, so a burst becomes a few evenly
spaced waves the server absorbs without throttling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self._lock = asyncio.Lock()  # FIFO: waiters are served in arrival order

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def take(self, n: float = 1.0) -> float:
        """Take `n` tokens if there are; else take nothing and return the seconds until there will be."""
        if n > self.burst:
            raise ValueError(f"cannot take {n} tokens from a bucket of {self.burst:g}")
        self._refill()
        if self._tokens >= n - 1e-9:  # float dust from the refill must not cost a sleep
            self._tokens = max(0.0, self._tokens - n)
            return 0.0
        return (n - self._tokens) / self.rate

    async def acquire(self, n: float = 1.0) -> None:
        async with self._lock:
            while (wait := self.take(n)) > 0:  # noqa: ASYNC110 - a token bucket waits for time, not an event
                await asyncio.sleep(wait)

    @property
    def available(self) -> float:
        self._refill()
        return self._tokens
