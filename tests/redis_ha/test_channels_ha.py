"""Pub/sub (state/channels.py) on a Cluster and behind Sentinel: a message published on any node
reaches a listener, whichever node it subscribed on; behind Sentinel the listener follows a failover."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis
from ha_servers import Cluster, Replicated
from redis.exceptions import RedisError
from testkit import eventually

from sandpool.state import channels
from sandpool.state.client import close, connect
from sandpool.state.keys import Keys


def test_a_message_published_on_any_cluster_node_reaches_the_listener(redis_cluster: Cluster,
                                                                       redis_prefix: str) -> None:
    channel = Keys(redis_prefix).pool_events

    async def run() -> None:
        received: list[str] = []
        client = connect(redis_cluster.url, timeout=2)
        task = asyncio.create_task(channels.listen(client, channel, received.append, poll_seconds=0.1))
        try:
            for node in redis_cluster.nodes:  # PUBLISH from inside a script runs on the key's node; any node here
                expected = f"from-{node.port}"

                def publish(port: int = node.port, data: str = expected) -> int:
                    with redis.Redis(port=port) as direct:
                        return int(direct.publish(channel, data))

                async def delivered(data: str = expected, publish_=publish) -> bool:
                    if data not in received:
                        await asyncio.to_thread(publish_)  # again until the subscription is in place
                        await asyncio.sleep(0.05)
                    return data in received

                await eventually(delivered, timeout=10, what=f"a message published on node {node.port}")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await close(client)

    asyncio.run(run())


def test_the_listener_follows_a_sentinel_failover(replicated: Replicated, redis_prefix: str) -> None:
    channel = Keys(redis_prefix).released_sessions

    async def run() -> None:
        received: list[str] = []
        client = connect(replicated.url, timeout=2)
        task = asyncio.create_task(channels.listen(client, channel, received.append, poll_seconds=0.1))

        async def publish(data: str) -> None:
            port = replicated.primary_port()
            try:
                async with aioredis.Redis(port=port, socket_timeout=1) as direct:
                    await direct.publish(channel, data)
            except RedisError:
                pass  # the old primary, gone: the Sentinels name the new one soon

        async def delivered(data: str) -> bool:
            if data not in received:
                await publish(data)
                await asyncio.sleep(0.05)
            return data in received

        try:
            await eventually(lambda: delivered("before"), timeout=10, what="a message before the failover")
            old = replicated.primary_port()
            replicated.kill_primary()
            await eventually(lambda: replicated.primary_port() != old, timeout=30, what="the Sentinels' failover")
            await eventually(lambda: delivered("after"), timeout=30, what="a message from the new primary")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await close(client)

    asyncio.run(run())
