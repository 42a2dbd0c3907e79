"""Listening to a pub/sub channel for as long as a caller wants, through Redis outages.

Messages on these channels are hints that make something happen sooner (a
controller tick, ending a released session's calls); whatever a lost message
would have triggered also happens by the periodic path that never depends on
them, so a reconnect after an outage is all the recovery needed.

The same code serves every `--redis-url` form. Behind Sentinel the reconnect asks the Sentinels
for the primary, so a listener follows a failover. On a Cluster the subscription is made on the
node owning the channel's slot (channel names carry the installation's hash tag, state/keys.py),
and a PUBLISH on any node, a script's included, reaches every node: classic pub/sub, since
sharded pub/sub needs Redis 7 and gains nothing at one channel per purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from sandpool.state.client import Client

log = logging.getLogger(__name__)

LEASE_NUDGE_PREFIX = "leased:"
"""How the nudge a lease or claim publishes begins (then the sandbox id; state/scripts.py): the only
nudge the controller may act on a little later, since nobody waits for the refill it asks for."""


async def listen(client: Client, channel: str, on_message: Callable[[str], None], *,
                 while_: Callable[[], bool] = lambda: True, poll_seconds: float = 1.0) -> None:
    """Call `on_message(data)` for each message on `channel` until cancelled or `while_()` is false.

    Reconnects with backoff; ends when `while_()` turns false even if a client library
    swallowed a cancellation.
    """
    delay = 0.2
    while while_():
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(channel)
            delay = 0.2
            while while_():
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=poll_seconds)
                if message is not None:
                    data = message.get("data")
                    on_message(data if isinstance(data, str) else str(data))
        except (RedisError, OSError) as exc:
            if while_():
                log.warning("pub/sub channel failed; reconnecting", extra={"channel": channel, "error": str(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # unannotated before redis-py 8.2
