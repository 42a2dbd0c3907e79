"""`sandpool egress` as a real process: it serves, answers its probes and metrics, stops cleanly on SIGTERM,
listens on a Unix socket too, and fails to start in one plain line."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from testkit import scrubbed_env

from .conftest import Egress, Outside, Process, connect_head, read_answer


async def test_the_process_serves_probes_metrics_tunnels_and_stops_cleanly(
        process: Process, egress: Egress, outside: Outside) -> None:
    bound = await egress.bind_session([f"files.example.test:{outside.https_tap.port}"])
    proxy = f"http://sandbox:{bound.credential}@127.0.0.1:{process.port}"
    async with httpx.AsyncClient(proxy=proxy, verify=outside.certificate.client_context(), trust_env=False) as client:
        response = await client.get(outside.https_url("/bytes/2048"))
    assert response.status_code == 200 and len(response.content) == 2048

    # the Unix socket serves the same proxy (local sandboxes reach it through a forwarded port)
    reader, writer = await asyncio.open_unix_connection(str(process.unix_socket))
    writer.write(connect_head(f"other.example.test:{outside.https_tap.port}", bound.credential).encode()
                 + b"\r\n\r\n")
    await writer.drain()
    refused = await read_answer(reader)
    writer.close()
    assert refused.status == 403 and b"egress_allow" in refused.body

    async with httpx.AsyncClient(trust_env=False) as client:
        healthz = await client.get(f"http://127.0.0.1:{process.port}/healthz")
        assert healthz.status_code == 200 and "UNSAFE TEST MODE" in healthz.text
        assert (await client.get(f"http://127.0.0.1:{process.metrics_port}/readyz")).status_code == 200
        metrics = (await client.get(f"http://127.0.0.1:{process.metrics_port}/metrics")).text
    assert "sandpool_egress_unsafe_test_mode 1.0" in metrics
    assert 'sandpool_egress_connections_total{kind="connect",outcome="done"} 1.0' in metrics
    assert 'sandpool_egress_refusals_total{reason="not_allowed"} 1.0' in metrics

    process.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(process.proc.wait, 30) == 0
    for _ in range(200):
        usage = await egress.usage(bound.workspace)
        if usage.get("egress_connections"):
            break
        await asyncio.sleep(0.05)
    assert int(usage["egress_connections"]) == 1
    assert await egress.store.ceiling() == [f"*:{outside.https_tap.port}"]  # published at start
    text = process.log.read_text()
    assert bound.credential not in text
    assert "UNSAFE TEST MODE" in text
    assert not process.unix_socket.exists()


def start(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    failure = tmp_path / "failure"
    done = subprocess.run([sys.executable, "-m", "sandpool", "egress", "--start-failure-file", str(failure), *argv],
                          capture_output=True, text=True, timeout=60, env=scrubbed_env())
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("sandpool egress: ")
    if failure.exists():
        assert failure.read_text().strip() in lines[0]
    return done


def test_the_loopback_allowance_is_refused_outside_the_tests(tmp_path: Path) -> None:
    done = start("--port", "0", "--unsafe-allow-loopback-for-tests", tmp_path=tmp_path)
    assert "--unsafe-mode tests" in done.stderr


def test_a_bad_ceiling_entry_is_one_line(tmp_path: Path) -> None:
    done = start("--port", "0", "--egress-allow-ceiling", "files.*.org", tmp_path=tmp_path)
    assert "--egress-allow-ceiling" in done.stderr and "files.*.org" in done.stderr


def test_a_busy_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = start("--port", str(port), tmp_path=tmp_path)
        assert f"port {port} is in use" in done.stderr and "--port" in done.stderr
        done = start("--port", "0", "--metrics-port", str(port), tmp_path=tmp_path)
        assert "--metrics-port" in done.stderr


def test_a_unix_socket_path_too_long_is_one_line(tmp_path: Path) -> None:
    done = start("--port", "0", "--unix-socket", str(tmp_path / ("s" * 120)), tmp_path=tmp_path)
    assert "--unix-socket" in done.stderr and "shorter" in done.stderr
