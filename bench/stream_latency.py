"""How long a streamed output chunk takes from the sandbox to the client: through the api (`sandpool up`,
auth on), and straight from one agent, side by side.

    python bench/stream_latency.py [--lines 100] [--interval 0.05] [--no-direct]

The program in the sandbox prints one line every `--interval` seconds, each stamped
with the host's clock (`time.time()`) as it is written; the agent sends each piece as
soon as it reads it from the program's pipe. The client reads the event stream off the
wire (`Accept: text/event-stream`) and stamps each event as it arrives. Per line:
arrival minus the stamp = pipe read + agent send (+ the api's relay). Prints
p50/p90/p99/max per path and the hop's share at p50. The issue's
target: every chunk reaches the client within 50 ms of the agent sending it
(a figure, not an assert: the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

STREAM = {"Accept": "text/event-stream"}


def program(lines: int, interval: float) -> str:
    return (f"import time\nfor i in range({lines}):\n"
            f"    print(f'{{i}} {{time.time()!r}}', flush=True)\n"
            f"    time.sleep({interval})\n")


def measure(client: httpx.Client, path: str, lines: int, interval: float) -> list[float]:
    """Milliseconds from each line's stamp to its event's arrival."""
    delays: list[float] = []
    body = {"tool": "code_execution", "input": {"code": program(lines, interval)}, "timeout_seconds": 300}
    pending = ""
    with client.stream("POST", path, json=body, headers=STREAM) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"{path}: {resp.status_code} {resp.read()[:300]!r}")
        name = ""
        for line in resp.iter_lines():
            arrived = time.time()
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name == "stdout":
                pending += json.loads(line[6:])["text"]
                *whole, pending = pending.split("\n")
                for text in whole:
                    delays.append((arrived - float(text.split()[1])) * 1000)
    if len(delays) != lines:
        raise SystemExit(f"{path}: {len(delays)} of {lines} lines arrived")
    return delays


def summary(name: str, delays: list[float]) -> float:
    ordered = sorted(delays)
    q = statistics.quantiles(ordered, n=100)
    print(f"{name:>28}: p50 {q[49]:6.2f} ms  p90 {q[89]:6.2f} ms  p99 {q[98]:6.2f} ms  max {ordered[-1]:6.2f} ms"
          f"  ({sum(d <= 50 for d in ordered)}/{len(ordered)} within 50 ms)")
    return q[49]


def through_up(args: argparse.Namespace, data_dir: Path) -> list[float]:
    port = 20000 + secrets.randbelow(20000)
    log = open(data_dir.parent / "up.log", "wb")  # closed below, after the process
    proc = subprocess.Popen([sys.executable, "-m", "sandpool", "up", "--port", str(port), "--data-dir",
                             str(data_dir), "--pool-size", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    try:
        found: dict[str, str] = {}
        assert proc.stdout is not None
        for raw in proc.stdout:
            key, _, value = raw.decode().strip().partition("=")
            if key in ("SANDPOOL_URL", "SANDPOOL_TOKEN"):
                found[key] = value
            if len(found) == 2:
                break
        if len(found) != 2:
            raise SystemExit("sandpool up did not start: see " + str(data_dir.parent / "up.log"))
        headers = {"Authorization": f"Bearer {found['SANDPOOL_TOKEN']}"}
        with httpx.Client(base_url=found["SANDPOOL_URL"], headers=headers, timeout=330) as client:
            sid = client.post("/sessions", json={}).json()["session_id"]
            measure(client, f"/sessions/{sid}/exec", 5, args.interval)  # warm-up
            return measure(client, f"/sessions/{sid}/exec", args.lines, args.interval)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def direct(args: argparse.Namespace, root: Path) -> list[float]:
    workspace = root / "ws"
    workspace.mkdir()
    sock = root / "agent.sock"
    secret = secrets.token_hex(16)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SANDPOOL_")}, "SANDPOOL_AGENT_SECRET": secret}
    proc = subprocess.Popen([sys.executable, "-m", "sandpool", "agent", "--uds", str(sock), "--workspace",
                             str(workspace)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(base_url="http://agent", transport=transport, timeout=330,
                          headers={"Authorization": f"Bearer {secret}"}) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the agent did not start")
                time.sleep(0.05)
            measure(client, "/sessions/s/exec", 5, args.interval)
            return measure(client, "/sessions/s/exec", args.lines, args.interval)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--no-direct", action="store_true", help="skip the direct agent measurement")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sbstream", dir="/tmp"))
    try:
        print(f"{args.lines} lines, one every {args.interval * 1000:g} ms; delay from the line's stamp to the "
              f"client reading its event")
        hops = summary("api + agent", through_up(args, root / "data"))
        if not args.no_direct:
            alone = summary("agent alone", direct(args, root))
            print(f"{'the api adds':>28}: {hops - alone:6.2f} ms at p50")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
