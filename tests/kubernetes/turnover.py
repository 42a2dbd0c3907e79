"""Measure the sandbox turnover the pool controller sustains with the Kubernetes provider.

Not a test (timing belongs outside the suite). Runs the real PoolController and
KubernetesProvider against the stand-in API server (stub kubelet) and a private
redis-server, while clients lease a sandbox and release it at once, as fast as
they can. Reports sandboxes created and destroyed per second over the steady
window, how often a lease found the pool empty, API calls per sandbox and 429s.

    python tests/kubernetes/turnover.py --seconds 10 --create-rate 10 --latency 0.01

What the number means is written down in docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
# E402 below: the imports need the two paths above (a script, run as `python tests/kubernetes/turnover.py`)

import redis.asyncio as aioredis  # noqa: E402 - see above
from apiserver import StandInApiServer  # noqa: E402 - see above
from testkit import RedisServer  # noqa: E402 - see above

from sandpool.controller.controller import PoolController  # noqa: E402 - see above
from sandpool.controller.provider import PoolSpec  # noqa: E402 - see above
from sandpool.providers.kubernetes import KubernetesProvider, KubernetesProviderSettings  # noqa: E402 - see above
from sandpool.state.keys import Keys  # noqa: E402 - see above
from sandpool.state.sessions import (  # noqa: E402 - see above
    Leased,
    SessionLimits,
    SessionStore,
)

LIMITS = SessionLimits(idle_timeout_seconds=300, max_lifetime_seconds=3600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)


async def measure(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="turnover-"))
    redis_server = RedisServer(work / "redis")
    redis_server.start()
    apiserver = StandInApiServer(kubelet="stub", latency=args.latency)
    apiserver.start()
    if args.server_writes:
        apiserver.throttle_writes(args.server_writes, args.server_writes)
    settings = KubernetesProviderSettings(
        kubeconfig=apiserver.kubeconfig(work / "kubeconfig"), kube_namespace="sandboxes",
        kube_agent_port=18080 + (uuid.uuid4().int % 1000), kube_create_rate=args.create_rate,
        kube_create_burst=args.create_burst, kube_delete_rate=args.delete_rate, kube_delete_burst=args.delete_burst)
    provider = KubernetesProvider(settings)
    await provider.start()
    redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys(prefix="turnover")
    pool = PoolSpec(name="default", image="python", warm=args.warm, ceiling=args.warm * 3)
    controller = PoolController(redis, keys, provider, [pool], replica_id="bench", tick_seconds=0.05,
                                max_concurrent_starts=args.warm, max_concurrent_destroys=args.warm)
    task = asyncio.create_task(controller.run())
    store = SessionStore(redis, keys)
    try:
        while await redis.llen(keys.pool_ready("default")) < args.warm:  # noqa: ASYNC110 - polls Redis on purpose
            await asyncio.sleep(0.05)
        created0, destroyed0 = provider.counts["created"], provider.counts["destroyed"]
        calls0 = provider.api.stats.calls
        leases = empty = 0
        deadline = time.monotonic() + args.seconds

        async def client(n: int) -> None:
            nonlocal leases, empty
            i = 0
            while time.monotonic() < deadline:
                session = f"c{n}-{i}"
                i += 1
                got = await store.lease(session_id=session, workspace=f"w{n}", pool="default", image="python",
                                        now=time.time(), limits=LIMITS, workspace_limits={})
                if isinstance(got, Leased):
                    leases += 1
                    await store.release(session_id=session, workspace=f"w{n}", now=time.time(), mode="destroy")
                else:
                    empty += 1
                    await asyncio.sleep(0.05)

        started = time.monotonic()
        await asyncio.gather(*(client(n) for n in range(args.clients)))
        elapsed = time.monotonic() - started
        created = provider.counts["created"] - created0
        destroyed = provider.counts["destroyed"] - destroyed0
        return {
            "seconds": round(elapsed, 2), "warm": args.warm, "create_rate_limit": args.create_rate,
            "api_latency_ms": args.latency * 1000, "leases": leases, "lease_attempts_on_empty_pool": empty,
            "created_per_second": round(created / elapsed, 1), "destroyed_per_second": round(destroyed / elapsed, 1),
            "api_calls_per_created_sandbox": round((provider.api.stats.calls - calls0) / max(created, 1), 2),
            "delete_calls": provider.counts["delete_calls"], "throttled_429": provider.api.stats.throttled,
        }
    finally:
        for _ in range(100):
            leftovers = [t for t in asyncio.all_tasks() if t.get_name().startswith("pool-controller")]
            if task.done() and not leftovers:
                break
            task.cancel()
            for leftover in leftovers:
                leftover.cancel()
            await asyncio.wait({task, *leftovers}, timeout=0.1)
        await provider.close()
        await redis.aclose()
        apiserver.stop()
        redis_server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--warm", type=int, default=50)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--create-rate", type=float, default=10)
    parser.add_argument("--create-burst", type=int, default=10)
    parser.add_argument("--delete-rate", type=float, default=20)
    parser.add_argument("--delete-burst", type=int, default=20)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to every API request")
    parser.add_argument("--server-writes", type=float, default=0, help="API server write limit per second (0: none)")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        print(json.dumps(asyncio.run(measure(args))))


if __name__ == "__main__":
    main()
