"""Shared state in Redis: the key schema, every record, every script, behind a small typed API.

No module outside this package imports `redis` or issues a Redis command; the
session layer, the edge and the controller use the stores here, and see only
`StateUnavailable` / `StateError` when Redis fails.
"""

from sandpool.state.client import Client, close, connect, ping
from sandpool.state.errors import StateError, StateUnavailable
from sandpool.state.keys import Keys

__all__ = ["Client", "Keys", "StateError", "StateUnavailable", "close", "connect", "ping"]
