"""The Redis client every service uses, built in one place (timeouts, pool size, decoding), for each of
the deployments `--redis-url` names: one server, a primary the Sentinels follow, or a Cluster.

    redis://[:password@]host:port[/db]          (rediss:// with TLS; unix:// a socket)
    redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db]
    redis+cluster://[:password@]host:port[,host:port...]

The password is the data nodes' (primaries and replicas); the Sentinels are asked without one.
Behind Sentinel a lease is acknowledged by a replica before it is answered (`acknowledging_replicas`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote

import redis as redis_sync
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from sandpool.core.redact import redact
from sandpool.core.settings import ConfigurationError
from sandpool.state.errors import UNREACHABLE, StateUnavailable, translated

log = logging.getLogger(__name__)

Client = aioredis.Redis
"""What the stores are handed. A Cluster client is not a subclass, but it answers every command,
script and pipeline the stores use the same way, their keys all in one slot (tests/redis_ha)."""

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
PASSWORD = " (with a password: :password@ before the first host)"
SENTINEL_FORM = "redis+sentinel://host:port[,host:port...]/service_name[/db]" + PASSWORD
CLUSTER_FORM = "redis+cluster://host:port[,host:port...]" + PASSWORD
FORMS = ("redis://host:port[/db], rediss://host:port[/db], unix:///path, "
         "redis+sentinel://host:port[,host:port...]/service_name[/db] or redis+cluster://host:port[,host:port...]"
         + PASSWORD)
"""The forms as an error names them: written so that `redact` (which blanks a URL's userinfo) keeps them."""


@dataclass(frozen=True)
class Target:
    """Where `--redis-url` points: `kind` is `server`, `sentinel` or `cluster`."""

    kind: str
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = None
    service: str = ""
    db: int = 0


def parse(url: str) -> Target:
    """Read a `--redis-url`; `ConfigurationError` naming the expected form when it is malformed."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise ConfigurationError(f"--redis-url {redact(url)}: not a URL; expected {FORMS}")
    if scheme not in (SENTINEL_SCHEME, CLUSTER_SCHEME):
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigurationError(f"--redis-url {redact(url)}: unknown scheme {scheme!r}; expected {FORMS}")
        return Target("server", url)
    form = SENTINEL_FORM if scheme == SENTINEL_SCHEME else CLUSTER_FORM
    location, _, path = rest.partition("/")
    if "?" in path or "#" in path or "?" in location:
        raise ConfigurationError(f"--redis-url {redact(url)}: takes no query; expected {form}")
    userinfo, at, hosts = location.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    nodes = tuple(_node(part, url, form) for part in hosts.split(","))
    if scheme == CLUSTER_SCHEME:
        if path.strip("/"):
            raise ConfigurationError(f"--redis-url {redact(url)}: a Cluster has no service name or db; "
                                     f"expected {form}")
        return Target("cluster", url, nodes, username, password)
    service, _, db = path.partition("/")
    if not service:
        raise ConfigurationError(f"--redis-url {redact(url)}: names no service; expected {form}")
    if db and not db.isdigit():
        raise ConfigurationError(f"--redis-url {redact(url)}: db {db!r} is not a number; expected {form}")
    return Target("sentinel", url, nodes, username, password, unquote(service), int(db or 0))


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _node(part: str, url: str, form: str) -> tuple[str, int]:
    host, colon, port = part.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(f"--redis-url {redact(url)}: {part!r} is not host:port; expected {form}")
    return host, int(port)


WAIT_TIMEOUT_MS = 100
"""How long a lease waits for a replica's acknowledgement (Redis WAIT) before it is answered anyway."""

_ACKNOWLEDGING: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def acknowledging_replicas(client: aioredis.Redis) -> int:
    """How many replicas must have a lease before it is answered (Redis WAIT): 0 (no WAIT) unless the
    client was connected with more; `connect` gives a Sentinel deployment's clients 1."""
    return _ACKNOWLEDGING.get(client, 0)


async def acknowledged(client: aioredis.Redis, script: AsyncScript, *, keys: list[str], args: list[Any],
                       when: Callable[[Any], bool]) -> Any:
    """Run `script`; if its answer is one `when` says must survive a failover (a lease), wait until
    `acknowledging_replicas(client)` replicas have it, for up to WAIT_TIMEOUT_MS, before answering.

    WAIT counts the writes of the connection it is sent on, so the script and the WAIT share one.
    A replica that does not acknowledge in time is logged and the answer given all the same: the
    write stands on the primary. Should a failover then lose it, the sandbox could be leased again;
    DESIGN.md's agent fence (`agent.fence`: serve only the first session called for) refuses the
    second session, and that sandbox ends (docs/agent.md, "The session fence")."""
    replicas = acknowledging_replicas(client)
    if not replicas:
        return await script(keys=keys, args=args)
    async with client.client() as connection:  # one connection for both
        result = await script(keys=keys, args=args, client=connection)
        if when(result):
            count = int(await connection.wait(replicas, WAIT_TIMEOUT_MS))
            if count < replicas:
                _unacknowledged(replicas, count)
    return result


_last_unacknowledged_log = 0.0


def _unacknowledged(replicas: int, count: int) -> None:
    """Say so, at most every 10 s: with the replica gone every lease is unacknowledged."""
    global _last_unacknowledged_log
    now = time.monotonic()
    if now - _last_unacknowledged_log >= 10.0:
        _last_unacknowledged_log = now
        log.warning("a lease was not acknowledged by a replica in time; answered anyway (a failover now "
                    "could lose it)", extra={"replicas": replicas, "acknowledged": count, "wait_ms": WAIT_TIMEOUT_MS})


def _retry() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.25), retries=2,
                 supported_errors=(RedisConnectionError,))


class _Cluster(RedisCluster):
    """A Cluster client whose "no node reachable" is a connection error, as any Redis outage's is:
    redis-py's RedisClusterException is no RedisError, so the stores' translation would let it
    through (a 500, or an api that fails to start, instead of a 503 and a start that waits)."""

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        try:
            return await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise RedisConnectionError(str(exc)) from exc

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise RedisConnectionError(str(exc)) from exc


def connect(url: str, *, timeout: float, max_connections: int = 256,
            wait_replicas: int | None = None) -> aioredis.Redis:
    """An asyncio client: every command bounded by `timeout`, connections pooled and health-checked.

    A command whose connection fails is sent again, up to twice, on a fresh connection: after a
    Redis restart every pooled connection is dead, and without this each one costs a caller a 503
    (redis-py retries nothing unless told). Timeouts are not retried, so a stalled Redis still fails
    within `timeout`. A script whose answer was lost with its connection may run twice: the lease
    and a waiter's claim answer the repeat with what their first run did (a session id is theirs
    alone); the others are no worse than a caller retrying on the 503.

    Behind Sentinel each fresh connection asks the Sentinels for the primary, so the retry after a
    failover reaches the new one (a demoted primary's READONLY answer closes the connection the
    same way). A Cluster client routes each command by its key's slot and follows MOVED itself.

    `wait_replicas`: how many replicas acknowledge a lease (`acknowledging_replicas`); by default 1
    behind Sentinel (which only exists to promote a replica) and 0 otherwise. A Cluster client never
    waits: WAIT would have to run on the connection to the slot's primary that ran the lease."""
    target = parse(url)
    options: dict[str, Any] = {
        "decode_responses": True, "socket_timeout": timeout, "socket_connect_timeout": timeout,
        "max_connections": max_connections, "retry": _retry(),
    }
    if target.kind == "server":
        server: aioredis.Redis = aioredis.Redis.from_url(url, health_check_interval=30, **options)
        if wait_replicas:
            _ACKNOWLEDGING[server] = wait_replicas
        return server
    credentials: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.kind == "cluster":
        cluster = _Cluster(startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
                               health_check_interval=30, **credentials, **options)
        return cast(aioredis.Redis, cluster)
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs={"socket_timeout": timeout,
                                                             "socket_connect_timeout": timeout})
    client: aioredis.Redis = sentinel.master_for(target.service, db=target.db, health_check_interval=30,
                                                 **credentials, **options)
    replicas = 1 if wait_replicas is None else wait_replicas
    if replicas > 0:
        _ACKNOWLEDGING[client] = replicas
    return client


@translated
async def ping(client: aioredis.Redis) -> bool:
    return bool(await client.ping())


async def close(client: aioredis.Redis) -> None:
    """Close the client's connections, and behind Sentinel its connections to the Sentinels too (a
    connection left to the garbage collector warns from wherever the collector happens to run)."""
    await client.aclose()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        await sentinel.aclose()


@contextmanager
def _sync_client(url: str, timeout: float) -> Iterator[Any]:
    """A blocking client for command-line tools, for any URL form; `StateUnavailable` if Redis is away."""
    target = parse(url)
    options: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    credentials: dict[str, Any] = {"username": target.username, "password": target.password}
    node: Any = redis_sync.cluster.ClusterNode  # unannotated in redis-py
    client: Any
    try:
        if target.kind == "server":
            client = redis_sync.Redis.from_url(url, **options)
        elif target.kind == "cluster":
            client = redis_sync.RedisCluster(
                startup_nodes=[node(host, port) for host, port in target.nodes],
                **credentials, **options)
        else:
            sentinel = redis_sync.Sentinel(list(target.nodes), sentinel_kwargs=options)
            client = sentinel.master_for(target.service, db=target.db, **credentials, **options)
    except (*UNREACHABLE, redis_sync.RedisError, RedisClusterException, OSError) as exc:  # a Cluster client
        raise StateUnavailable(f"Redis at {redact(url)} does not answer ({exc})") from None  # asks for its slots here
    try:
        yield client
    except (*UNREACHABLE, redis_sync.RedisError, RedisClusterException, OSError) as exc:
        raise StateUnavailable(f"Redis at {redact(url)} does not answer ({exc})") from None
    finally:
        client.close()


def ping_sync(url: str, *, timeout: float = 2.0) -> None:
    """For command-line tools before their event loop runs: raise `StateUnavailable` naming the
    (redacted) URL when Redis does not answer."""
    with _sync_client(url, timeout) as client:
        client.ping()


def ready_count_sync(url: str, ready_key: str, *, timeout: float = 2.0) -> int:
    """How many sandboxes a pool has ready, for command-line tools (`StateUnavailable` if Redis is away)."""
    with _sync_client(url, timeout) as client:
        return int(client.llen(ready_key))
