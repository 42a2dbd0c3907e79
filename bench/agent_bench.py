"""Latency of the agent alone: start-up, first call, and p50/p99 of `print(1)` and `echo hi`.

    python bench/agent_bench.py [--calls 300] [--uds | --tcp]

Starts a real `sandpool agent` on a Unix socket (default) in a temporary
workspace, talks to it over httpx, and stops it. Loopback only, bounded.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def call(client: httpx.Client, tool: str, **fields: object) -> float:
    started = time.perf_counter()
    resp = client.post("/sessions/bench/exec", json={"tool": tool, "input": fields})
    elapsed = (time.perf_counter() - started) * 1000
    resp.raise_for_status()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--tcp", action="store_true", help="loopback TCP instead of a Unix socket")
    args = parser.parse_args()
    secret = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDPOOL_")} | {"SANDPOOL_AGENT_SECRET": secret}
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        ws.mkdir()
        if args.tcp:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            where = ["--host", "127.0.0.1", "--port", str(port)]
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                                  headers={"Authorization": f"Bearer {secret}"})
        else:
            sock = Path(tmp) / "agent.sock"
            where = ["--uds", str(sock)]
            client = httpx.Client(base_url="http://agent", timeout=30, transport=httpx.HTTPTransport(uds=str(sock)),
                                  headers={"Authorization": f"Bearer {secret}"})
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "sandpool", "agent", *where, "--workspace", str(ws),
                                 "--log-level", "warning", "--interrupt-grace-seconds", "0.2"],
                                env=env, cwd=REPO, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if client.get("/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    print("agent did not start", file=sys.stderr)
                    return 1
                time.sleep(0.005)
            start_ms = (time.perf_counter() - t0) * 1000
            first_py = call(client, "code_execution", code="print(1)")
            first_sh = call(client, "bash_code_execution", command="echo hi")
            py = [call(client, "code_execution", code="print(1)") for _ in range(args.calls)]
            sh = [call(client, "bash_code_execution", command="echo hi") for _ in range(args.calls)]
            ed = [call(client, "text_editor_code_execution", command="view", path=".") for _ in range(args.calls)]
            # After a hard timeout the spare interpreter takes over: the next call's latency.
            client.post("/sessions/bench/exec", json={
                "tool": "code_execution", "timeout_seconds": 1,
                "input": {"code": "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                  "time.sleep(30)"}})
            after_restart = call(client, "code_execution", code="print(1)")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
            client.close()
    transport = "tcp" if args.tcp else "uds"
    print(f"agent bench ({transport}, {args.calls} calls each, 1 client, {os.cpu_count()} cpus)")
    print(f"  start to /healthz ready      {start_ms:7.1f} ms")
    print(f"  first print(1)               {first_py:7.2f} ms")
    print(f"  first echo hi                {first_sh:7.2f} ms")
    for name, values in (("print(1)", py), ("echo hi", sh), ("editor view .", ed)):
        print(f"  {name:<14} p50 {statistics.median(values):6.2f} ms  p99 {pct(values, 99):6.2f} ms"
              f"  max {max(values):6.2f} ms")
    print(f"  print(1) after a restart     {after_restart:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
