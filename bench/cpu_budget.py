"""CPU per churned session, by component, against `sandpool up` with auth on: the pool must beat on demand.

    python bench/cpu_budget.py                       # 300 sessions, 16 clients, then the latency and 64-client phases
    python bench/cpu_budget.py --sessions 600 --json bench/results/cpu.json --profile bench/results/profiles

One churned session is the contract's typical use: CreateSession, five `print(1)`
Execute calls, DestroySession. `--clients` clients (each with its own connections, as
independent callers have) churn `--sessions` sessions
through the api (auth on: the printed dev token). CPU is read before and after
from the kernel's own accounting, the stack settled both times (no sandbox
starting or doomed), so the warm-ups a session causes are counted:

- api (the edge over the session layer), controller (pool controller, session
  reaper, provider), redis, zygote, runner template: each process's user+system
  time (/proc/<pid>/stat);
- sandboxes (agent, interpreter, shell, everything they ran): a cpuacct cgroup the
  zygote and its runner templates are put in before the run (cgroup v1), or the
  zygote's cgroup (v2), minus the zygote's and the templates' own time: charges stay
  with the group after each sandbox is gone;
- the whole machine (/proc/stat: all but idle and iowait) minus the load client
  (this process): what serving the sessions cost, kernel work included (namespace
  teardown runs in kernel threads nobody's cgroup pays for);
- "kernel and rest" is the whole machine minus the components and the client.

Then, with one client and the pool warm: `print(1)` through the api
against the same call made straight to the session's agent (p50 overhead);
CreateSession p50/p99 for one session every 100 ms (each destroyed after); and
CreateSession to the first result, with that first call's share, and the same first
call of a fresh session sent straight to its agent (what is left without the api).
Then 64 clients: throughput against 16 and
dropped connections. `--profile DIR` records py-spy profiles (collapsed stacks)
of the api, the controller and the sandboxes (the zygote and its forks) during
the churn, and reports which share of the controller's samples the pool
controller and the provider took. Prints a table and writes JSON. Needs root
(cgroups, py-spy).

The budget was set for the retired topology (proxy 5 ms, scheduler with its
controller 10 ms); the api and the controller now share those 15 ms between them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from load import PRINT_1, Client, Counters, StartedUp, callers, ms, pct

CLK_TCK = os.sysconf("SC_CLK_TCK")
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
BUDGET_MS = {"api and controller together": 15, "redis": 3, "sandbox start and teardown (incl. kernel)": 25,
             "agent and interpreter (5 x print(1))": 15, "whole machine minus client": 60}


# --- where the CPU goes ------------------------------------------------------------------------------

def _stat(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rfind(")") + 2:].split()


def process_seconds(pid: int) -> float:
    """user+system of the process itself (its threads), not of its children."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def system_seconds(pid: int) -> float:
    """The kernel's share of `process_seconds` (syscalls, mounts, page faults)."""
    return int(_stat(pid)[12]) / CLK_TCK


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat(int(entry.name))[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def machine_seconds() -> float:
    """Busy CPU of the whole machine: every /proc/stat cpu column but idle and iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def client_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Stack:
    """The processes of one `sandpool up`, found from its pid."""

    up: StartedUp
    pids: dict[str, int] = field(default_factory=dict)
    templates: list[int] = field(default_factory=list)
    """The zygote's runner templates (agent/runner_template.py): they fork the sandboxes' runners."""
    cgroup: Path | None = None

    def find(self) -> None:
        for pid in children_of(self.up.proc.pid):
            line = cmdline(pid)
            for name, needle in (("api", "sandpool api"), ("controller", "sandpool controller"),
                                 ("redis", "redis-server")):
                if needle in line:
                    self.pids[name] = pid
        for pid in children_of(self.pids.get("controller", -1)):
            if "zygote_server" in cmdline(pid):
                self.pids["zygote"] = pid
        if "zygote" in self.pids:
            self.templates = [pid for pid in children_of(self.pids["zygote"]) if "--template" in cmdline(pid)]
        missing = {"api", "controller", "redis", "zygote"} - set(self.pids)
        if missing:
            raise SystemExit(f"cpu_budget: not found in the stack: {', '.join(sorted(missing))} "
                             "(is auth on and the zygote launcher in use?)")

    def account_sandboxes(self) -> None:
        """A cpuacct group for the zygote, so every sandbox it forks is charged there for good."""
        if CPUACCT.is_dir():
            group = CPUACCT / f"sandpool-cpu-budget-{os.getpid()}"
            group.mkdir(exist_ok=True)
            for pid in (self.pids["zygote"], *self.templates):  # the runners are the templates' forks
                (group / "cgroup.procs").write_text(str(pid))
            self.cgroup = group / "cpuacct.usage"
            return
        line = Path(f"/proc/{self.pids['zygote']}/cgroup").read_text().splitlines()
        unified = [entry.split(":", 2)[2] for entry in line if entry.startswith("0::")]
        if not unified:
            raise SystemExit("cpu_budget: no cpuacct hierarchy and no cgroup v2 to account the sandboxes with")
        self.cgroup = Path("/sys/fs/cgroup") / unified[0].lstrip("/") / "cpu.stat"

    def sandbox_group_seconds(self) -> float:
        assert self.cgroup is not None
        text = self.cgroup.read_text()
        if self.cgroup.name == "cpuacct.usage":
            return int(text) / 1e9
        usage = re.search(r"^usage_usec (\d+)", text, re.M)
        return int(usage.group(1)) / 1e6 if usage else 0.0

    def release(self) -> None:
        if self.cgroup is not None and self.cgroup.name == "cpuacct.usage":
            group = self.cgroup.parent
            try:
                for pid in group.joinpath("cgroup.procs").read_text().split():
                    (CPUACCT / "cgroup.procs").write_text(pid)
                group.rmdir()
            except OSError:
                pass

    def snapshot(self) -> dict[str, float]:
        seconds = {name: process_seconds(pid) for name, pid in self.pids.items()}
        seconds.update({f"{name} system": system_seconds(pid) for name, pid in self.pids.items()})
        seconds["runner template"] = sum(process_seconds(pid) for pid in self.templates)
        seconds["sandbox group"] = self.sandbox_group_seconds()
        seconds["machine"] = machine_seconds()
        seconds["client"] = client_seconds()
        return seconds


def redis_of(stack: Stack) -> Any:
    """A client of the stack's own Redis (its port and password from the config `up` wrote)."""
    import redis

    conf = (stack.up.data_dir / "redis" / "redis.conf").read_text()
    port = re.search(r"^port (\d+)", conf, re.M)
    password = re.search(r"^requirepass (\S+)", conf, re.M)
    assert port and password
    return redis.Redis(port=int(port.group(1)), password=password.group(1), decode_responses=True)


def redis_commands(stack: Stack) -> dict[str, int]:
    """Calls so far by Redis command (INFO commandstats): the round trips a session costs."""
    client = redis_of(stack)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def settle(stack: Stack, timeout: float = 120.0) -> None:
    """Wait until no sandbox is starting or doomed: a released session's teardown is counted."""
    from sandpool.state.keys import Keys

    keys = Keys()
    client = redis_of(stack)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            members = client.smembers(keys.pool_members("default"))
            states = [client.hget(keys.sandbox(m), "state") for m in members]
            if client.scard(keys.doomed) == 0 and "starting" not in states and "doomed" not in states:
                time.sleep(1.0)  # the last destroys' kernel work (namespace teardown) lands
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise SystemExit("cpu_budget: the pool did not settle")


# --- the churn ----------------------------------------------------------------------------------------

async def churn(url: str, token: str, clients: int, sessions: int, calls: int = 5) -> dict[str, Any]:
    counters = Counters()
    remaining = [sessions]

    async def one(http: httpx.AsyncClient) -> None:
        client = Client(http, counters)
        while remaining[0] > 0:
            remaining[0] -= 1
            got = await client.create(time.perf_counter() + 120)
            if got is None:
                return
            session = got[0]
            for _ in range(calls):
                await client.execute(session, PRINT_1, counters.print1)
            await client.destroy(session)
            counters.sessions += 1

    async with callers(url, token, clients) as https:
        started = time.perf_counter()
        await asyncio.gather(*(one(http) for http in https))
        elapsed = time.perf_counter() - started
    return {"clients": clients, "sessions": counters.sessions, "seconds": round(elapsed, 2),
            "sessions_per_s": round(counters.sessions / elapsed, 2), "execs_per_s": round(counters.execs / elapsed, 1),
            "create_session": ms(counters.create), "execute": ms(counters.print1),
            "destroy_session": ms(counters.destroy), "refused": counters.refused, "errors": counters.errors,
            "dropped_connections": counters.transport_errors}


# --- latency with one client --------------------------------------------------------------------------

def agent_client(stack: Stack, session: str) -> httpx.AsyncClient:
    """A client straight to the session's agent, with its address and secret read from Redis as the
    api reads them."""
    from sandpool.state.keys import Keys

    client = redis_of(stack)
    try:
        address, secret = client.hmget(Keys().session(session), "address", "secret")
    finally:
        client.close()
    assert address and secret, "the session is not in Redis"
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=address.removeprefix("unix://")),
                             base_url="http://agent", timeout=60, headers={"Authorization": f"Bearer {secret}"})


async def latencies(stack: Stack, url: str, token: str, calls: int, creates: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        session = (await http.post("/sessions", json={})).json()["session_id"]
        through: list[float] = []
        for _ in range(calls):
            started = time.perf_counter()
            response = await http.post(f"/sessions/{session}/exec", json=PRINT_1)
            through.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text
        direct: list[float] = []
        async with agent_client(stack, session) as agent:
            for _ in range(calls):
                started = time.perf_counter()
                response = await agent.post(f"/sessions/{session}/exec", json=PRINT_1)
                direct.append(time.perf_counter() - started)
                assert response.status_code == 200, response.text
        await http.delete(f"/sessions/{session}")

        create: list[float] = []
        first: list[float] = []
        for _ in range(creates):
            started = time.perf_counter()
            response = await http.post("/sessions", json={})
            create.append(time.perf_counter() - started)
            sid = response.json()["session_id"]
            await http.post(f"/sessions/{sid}/exec", json=PRINT_1)
            first.append(time.perf_counter() - started)
            await http.delete(f"/sessions/{sid}")
            await asyncio.sleep(max(0.0, 0.1 - (time.perf_counter() - started)))  # one every 100 ms
        first_direct = await first_calls_direct(stack, http, max(10, creates // 3))
    p50_through, p50_direct = pct(through, 50) * 1000, pct(direct, 50) * 1000
    return {"print_1_through_api": ms(through), "print_1_direct_to_agent": ms(direct),
            "print_1_overhead_p50_ms": round(p50_through - p50_direct, 2),
            "create_session_every_100ms": ms(create), "create_to_first_result": ms(first),
            "first_print_1_through": ms([f - c for f, c in zip(first, create, strict=True)]),
            "first_print_1_direct_to_agent": ms(first_direct)}


async def first_calls_direct(stack: Stack, http: httpx.AsyncClient, sessions: int) -> list[float]:
    """A fresh session's first `print(1)` sent straight to its agent (connection opened before), at the
    same pace: the agent's and interpreter's share of the first call, without the hops."""
    samples: list[float] = []
    for _ in range(sessions):
        started = time.perf_counter()
        sid = (await http.post("/sessions", json={})).json()["session_id"]
        async with agent_client(stack, sid) as agent:
            (await agent.get("/healthz")).raise_for_status()
            called = time.perf_counter()
            response = await agent.post(f"/sessions/{sid}/exec", json=PRINT_1)
            samples.append(time.perf_counter() - called)
            assert response.status_code == 200, response.text
        await http.delete(f"/sessions/{sid}")
        await asyncio.sleep(max(0.0, 0.1 - (time.perf_counter() - started)))
    return samples


# --- profiles -----------------------------------------------------------------------------------------

def start_profiles(stack: Stack, directory: Path, seconds: float) -> list[subprocess.Popen[bytes]]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("cpu_budget: --profile needs py-spy (pip install py-spy)")
    directory.mkdir(parents=True, exist_ok=True)
    procs = []
    for name in ("api", "controller", "zygote"):
        extra = ["--subprocesses"] if name == "zygote" else []
        procs.append(subprocess.Popen(
            [py_spy, "record", "--pid", str(stack.pids[name]), "--format", "raw", "--rate", "200", "--nonblocking",
             "--duration", str(int(seconds) + 1), "--output", str(directory / f"{name}.txt"), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def controller_share(collapsed: Path) -> float | None:
    """The share of the controller process's samples spent in the pool controller and the provider (their
    modules in the stack; the rest is its HTTP server, the session reaper, Redis I/O)."""
    total = controller = 0
    try:
        lines = collapsed.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        stack_text, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        if "controller/controller.py" in stack_text or "providers/local" in stack_text:
            controller += int(count)
    return round(controller / total, 3) if total else None


# --- the report -------------------------------------------------------------------------------------

def per_session(before: dict[str, float], after: dict[str, float], sessions: int) -> dict[str, float]:
    spent = {name: after[name] - before[name] for name in before}
    out = {name: round(spent[name] / sessions * 1000, 2) for name in ("api", "controller", "redis", "zygote")}
    out["api and controller together"] = round(out["api"] + out["controller"], 2)
    out["runner template"] = round(spent["runner template"] / sessions * 1000, 2)
    out["sandboxes (agent, interpreter, shell)"] = round(
        (spent["sandbox group"] - spent["zygote"] - spent["runner template"]) / sessions * 1000, 2)
    out["whole machine minus client"] = round((spent["machine"] - spent["client"]) / sessions * 1000, 2)
    out["load client"] = round(spent["client"] / sessions * 1000, 2)
    counted = sum(v for k, v in out.items()
                  if k not in ("whole machine minus client", "load client", "api and controller together"))
    out["kernel and rest"] = round(out["whole machine minus client"] - counted, 2)
    for name in ("api", "controller", "redis", "zygote"):
        out[f"{name}: of which system"] = round(spent[f"{name} system"] / sessions * 1000, 2)
    return out


def table(rows: dict[str, float], title: str) -> str:
    width = max(len(k) for k in rows) + 2
    lines = [title, "-" * len(title)]
    lines += [f"{name:<{width}}{value:>9.2f} ms" for name, value in rows.items()]
    return "\n".join(lines)


async def measure(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    assert stack.up.url and stack.up.token
    url, token = stack.up.url, stack.up.token
    report: dict[str, Any] = {"cores": os.cpu_count(), "sessions": args.sessions, "clients": args.clients}
    await churn(url, token, args.clients, args.warmup)  # caches, arenas and the warm target warmed up
    settle(stack)
    profiles = start_profiles(stack, args.profile, 600) if args.profile else []
    commands_before = redis_commands(stack)
    before = stack.snapshot()
    result = await churn(url, token, args.clients, args.sessions)
    settle(stack)
    after = stack.snapshot()
    commands_after = redis_commands(stack)
    for proc in profiles:
        proc.send_signal(2)  # SIGINT: py-spy writes what it has
    for proc in profiles:
        proc.wait(60)
    report["churn"] = result
    report["cpu_ms_per_session"] = per_session(before, after, result["sessions"])
    report["redis_calls_per_session"] = {
        name: round((calls - commands_before.get(name, 0)) / result["sessions"], 2)
        for name, calls in sorted(commands_after.items(), key=lambda kv: commands_before.get(kv[0], 0) - kv[1])
        if calls > commands_before.get(name, 0) and name != "info"}
    if args.profile:
        report["profiles"] = str(args.profile)
        report["controller_share_in_pool_controller"] = controller_share(args.profile / "controller.txt")
    if args.quick:
        return report
    report["latency"] = await latencies(stack, url, token, args.calls, args.creates)
    settle(stack)
    report["concurrent_64"] = await churn(url, token, 64, args.sessions)
    report["throughput_64_over_16"] = round(report["concurrent_64"]["sessions_per_s"] / result["sessions_per_s"], 2)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=300, help="sessions churned in the measured phase")
    parser.add_argument("--warmup", type=int, default=60, help="sessions churned before measuring")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients of the churn")
    parser.add_argument("--calls", type=int, default=200, help="print(1) calls of the latency phase")
    parser.add_argument("--creates", type=int, default=100, help="CreateSessions of the latency phase")
    parser.add_argument("--port", type=int, default=18180, help="port of the `sandpool up` started")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--profile", type=Path, default=None, help="write py-spy profiles (collapsed) here")
    parser.add_argument("--quick", action="store_true", help="the churn only (no latency or 64-client phase)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("cpu_budget: run as root (cgroup accounting, the zygote's isolation, py-spy)")
    up = StartedUp(None, None, args.port, auth=True)
    stack = Stack(up)
    try:
        stack.find()
        stack.account_sandboxes()
        report = asyncio.run(measure(stack, args))
    finally:
        stack.release()
        up.stop()
    print(table(report["cpu_ms_per_session"], f"CPU per churned session ({report['churn']['sessions']} sessions, "
                                              f"{args.clients} clients, {report['cores']} cores)"))
    print("\nbudget (DESIGN.md):", ", ".join(f"{k} {v} ms" for k, v in BUDGET_MS.items()))
    calls = report["redis_calls_per_session"]
    print(f"\nredis calls per session {sum(calls.values()):.1f}: "
          + ", ".join(f"{name} {count}" for name, count in calls.items()))
    churned = report["churn"]
    print(f"\nsessions/s {churned['sessions_per_s']}, execs/s {churned['execs_per_s']}, "
          f"create p50/p99 {churned['create_session']['p50_ms']}/{churned['create_session']['p99_ms']} ms, "
          f"execute p50/p99 {churned['execute']['p50_ms']}/{churned['execute']['p99_ms']} ms, "
          f"dropped {churned['dropped_connections']}")
    if args.quick:
        return _write(report, args.json)
    latency = report["latency"]
    print(f"print(1) p50: through the api {latency['print_1_through_api']['p50_ms']} ms, "
          f"direct {latency['print_1_direct_to_agent']['p50_ms']} ms (+{latency['print_1_overhead_p50_ms']} ms); "
          f"CreateSession every 100 ms p50/p99 {latency['create_session_every_100ms']['p50_ms']}/"
          f"{latency['create_session_every_100ms']['p99_ms']} ms; "
          f"create to first result p50 {latency['create_to_first_result']['p50_ms']} ms (its print(1) "
          f"{latency['first_print_1_through']['p50_ms']} ms; a fresh agent's first print(1) direct "
          f"{latency['first_print_1_direct_to_agent']['p50_ms']} ms)")
    c64 = report["concurrent_64"]
    print(f"64 clients: {c64['sessions_per_s']} sessions/s ({report['throughput_64_over_16']} x 16 clients), "
          f"dropped {c64['dropped_connections']}, errors {c64['errors']}")
    if "controller_share_in_pool_controller" in report:
        print(f"profiles in {report['profiles']}; controller samples in the pool controller and provider: "
              f"{report['controller_share_in_pool_controller']}")
    return _write(report, args.json)


def _write(report: dict[str, Any], path: Path | None) -> int:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
