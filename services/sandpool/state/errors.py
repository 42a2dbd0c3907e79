"""The two ways shared state can fail, as this project names them (no caller sees a redis exception).

`StateUnavailable`: Redis could not be reached or did not answer in time; the
services answer 503 with Retry-After and carry on when it is back.
`StateError`: Redis answered with an error (a script bug, a wrong type): a
defect, never a reason to retry forever.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

P = ParamSpec("P")
T = TypeVar("T")

UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)


class StateError(Exception):
    """Redis refused a command or a script."""


class StateUnavailable(StateError):
    """Redis could not be reached or did not answer in time."""


def translated(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Turn Redis' exceptions raised by an async state call into this module's."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except UNREACHABLE as exc:
            raise StateUnavailable(str(exc) or type(exc).__name__) from exc
        except RedisError as exc:
            raise StateError(str(exc) or type(exc).__name__) from exc
        except OSError as exc:
            raise StateUnavailable(str(exc) or type(exc).__name__) from exc

    return call
