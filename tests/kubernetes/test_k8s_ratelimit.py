"""The token bucket's arithmetic on a clock the test moves (no sleeping, no timing)."""

from __future__ import annotations

import asyncio

import pytest

from sandpool.providers.kubernetes.ratelimit import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=10, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.1)  # empty: one token comes in 1/rate seconds
    clock.now += 0.05
    assert bucket.take() == pytest.approx(0.05)
    clock.now += 0.05
    assert bucket.take() == 0.0
    clock.now += 60  # idle for a minute: refills to the burst, never beyond
    assert bucket.available == pytest.approx(3)
    assert [bucket.take() for _ in range(4)][-1] == pytest.approx(0.1)


def test_refusals_take_nothing() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=1, burst=2, clock=clock)
    bucket.take(2)
    for _ in range(5):
        assert bucket.take() > 0
    clock.now += 1
    assert bucket.take() == 0.0  # five refusals did not dig a hole


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (1, 0)])
def test_bad_parameters(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="rate > 0 and burst >= 1"):
        TokenBucket(rate=rate, burst=burst)


def test_more_than_the_burst_can_never_be_taken() -> None:
    with pytest.raises(ValueError, match="cannot take 3 tokens"):
        TokenBucket(rate=1, burst=2).take(3)


async def test_acquire_serves_waiters_in_order() -> None:
    bucket = TokenBucket(rate=1000, burst=1)
    order: list[int] = []

    async def one(i: int) -> None:
        await bucket.acquire()
        order.append(i)

    await asyncio.gather(*(one(i) for i in range(5)))
    assert order == [0, 1, 2, 3, 4]
