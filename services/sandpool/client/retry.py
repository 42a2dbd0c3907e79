"""When to offer a call again, and how long to wait first. Pure functions; no I/O.

A retry is bounded three ways: a number of retries, a total wait across them,
and a per-retry cap on the backoff the client picks itself. A server's
`Retry-After` is honoured as given (plus a little jitter so refused clients do
not return in lockstep); when it asks for more than the remaining budget the
client gives up at once and raises, with `retry_after` on the error, rather than
sleeping past what the caller allowed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header: delta-seconds or an HTTP-date.

    Returns None for an absent or unparseable header (the caller then picks its
    own backoff); a date in the past reads as 0.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isdigit():
        return float(int(text))
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        # Not in the RFC, but some servers send "1.5"; negative or NaN is garbage.
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    current = now or datetime.now(UTC)
    return max(0.0, (when - current).total_seconds())


@dataclass(frozen=True)
class RetryPolicy:
    """Bounds on automatic retries.

    `max_retries` retries at most (so `max_retries + 1` attempts); the sum of the
    waits never exceeds `max_total_wait` seconds. Without a `Retry-After` the wait
    before retry *n* (from 0) is drawn from [cap/2, cap] with
    `cap = min(max_backoff, base_backoff * 2**n)`.
    """

    max_retries: int = 3
    max_total_wait: float = 30.0
    base_backoff: float = 0.2
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.max_total_wait < 0 or self.base_backoff < 0 or self.max_backoff < 0:
            raise ValueError("retry waits must be >= 0")

    def backoff_cap(self, retry_number: int) -> float:
        return min(self.max_backoff, self.base_backoff * (2.0 ** min(retry_number, 32)))

    def next_delay(
        self,
        retry_number: int,
        *,
        retry_after: float | None,
        waited: float,
        rng: Callable[[], float] = random.random,
    ) -> float | None:
        """Seconds to sleep before retry number `retry_number` (0-based), or None to give up.

        `waited` is what earlier retries of this call already slept.
        """
        if retry_number >= self.max_retries:
            return None
        if retry_after is not None:
            delay = retry_after + rng() * min(1.0, 0.1 * retry_after)
        else:
            cap = self.backoff_cap(retry_number)
            delay = cap / 2 + rng() * cap / 2
        if waited + delay > self.max_total_wait:
            return None
        return delay


__all__ = ["RetryPolicy", "parse_retry_after"]
