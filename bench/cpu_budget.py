"""CPU per churned session, by component, against `sandpool up` with auth on, alone or beside the reference backend.

    python bench/cpu_budget.py                       # 300 sessions, 16 clients, then the latency and 64-client phases
    python bench/cpu_budget.py --sessions 600 --json bench/results/cpu.json --profile bench/results/profiles
    python bench/cpu_budget.py --reference /tmp/otari-ref --reference-python /tmp/otari-venv/bin/python --runs 3

One churned session is the contract's typical use: CreateSession, five `print(1)`
Execute calls, DestroySession. `--clients` clients (each with its own connections, as
independent callers have) churn `--sessions` sessions through the api (auth on: the
printed dev token). CPU is read from the kernel's own accounting over a window that
opens with the pool settled and closes only when the pool is back where it started
(the same ready count, nothing starting or doomed), so the teardown and refills a
session defers, and the warm target's way back down, are counted:

- api (the edge over the session layer), controller (pool controller, session
  reaper, provider), redis, zygote, runner template: each process's user+system
  time (/proc/<pid>/stat);
- sandboxes (agent, interpreter, shell, everything they ran): a cpuacct group the
  zygote and its runner templates are put in before the run (cgroup v1), or the
  zygote's cgroup (v2), minus the zygote's and the templates' own time: charges stay
  with the group after each sandbox is gone;
- the process tree: a cpuacct group holding the whole `sandpool up` tree, the
  sandboxes' group nested in it (cgroup v1; on v2 the sum of the parts above);
- the whole machine (/proc/stat: all but idle and iowait) minus the load client
  (this process, /proc/self/stat): what serving the sessions cost, kernel work
  included (namespace teardown runs in kernel threads nobody's cgroup pays for);
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

`--reference CHECKOUT` is DESIGN.md's yardstick: the same churn (same load client)
against the contract's reference backend (`reference.py`; no auth) and against
sandpool, one backend at a time, each started for its run and stopped after it,
interleaved s, r, s, r for `--runs` pairs. For each run: the whole machine minus the
load client and the backend's own process tree (a cpuacct group, so runners and
sandboxes count after they are gone) per churned session, over a window that closes
when the backend is back at rest (sandpool: its pool where it started; the reference:
its session runners gone). The machine's load with no backend running, read just
before and after each run, is reported beside it as context: on a shared machine the
whole-machine figure takes in everyone's work. Needs cgroup v1's cpuacct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from load import PRINT_1, Client, Counters, StartedUp, callers, ms, pct
from procstat import CpuGroup, children_of, cmdline, descendants_of, machine_seconds, process_seconds, system_seconds
from reference import Reference

BUDGET_MS = {"api": 5.5, "controller": 3.0, "redis": 1.5, "control plane (api, controller, redis)": 10.0,
             "sandbox (zygote, template, its processes)": 20.0, "process tree": 30.0}
"""DESIGN.md's guide per churned session on this machine kind, where the reference's process tree
spends about 30 ms: the control plane 10 ms, a sandbox's start, five calls and teardown with the
zygote's and templates' share 20 ms."""
BUDGET_RATIO = {"process tree": (1.0, 0.5), "whole machine minus client": (1.0, None)}
"""DESIGN.md's rule, sandpool over the reference (at most, goal): the process tree at most the
reference's, on the way to half; the whole machine minus the load client, over a window that
closes only when the backend is back at rest, is the figure that counts."""


@dataclass
class Stack:
    """The processes of one `sandpool up`, found from its pid."""

    up: StartedUp
    pids: dict[str, int] = field(default_factory=dict)
    templates: list[int] = field(default_factory=list)
    """The zygote's runner templates (agent/runner_template.py): they fork the sandboxes' runners."""
    tree: CpuGroup | None = None
    """cgroup v1: the whole `sandpool up` tree, with `sandboxes` nested in it."""
    sandboxes: CpuGroup | None = None
    """cgroup v1: the zygote, its templates and every sandbox they fork after the move."""
    unified: Path | None = None
    """cgroup v2: the zygote's group's cpu.stat (its sandboxes' groups are nested in it)."""
    polled: Counter[str] = field(default_factory=Counter)
    """The Redis calls the bench made itself to watch the pool, to leave out of the service's."""

    @property
    def url(self) -> str | None:
        return self.up.url

    @property
    def token(self) -> str | None:
        return self.up.token

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

    def account(self) -> None:
        """Groups that charge the whole tree and, nested, every sandbox the zygote forks, for good."""
        zygote = self.pids["zygote"]
        if CpuGroup.available():
            below_zygote = {zygote, *descendants_of(zygote)}
            self.tree = CpuGroup(f"sandpool-cpu-budget-{os.getpid()}")
            self.tree.add(self.up.proc.pid, *(p for p in descendants_of(self.up.proc.pid) if p not in below_zygote))
            self.sandboxes = CpuGroup("sandboxes", parent=self.tree)
            self.sandboxes.add(zygote, *self.templates)  # the runners are the templates' forks
            return
        lines = Path(f"/proc/{zygote}/cgroup").read_text().splitlines()
        unified = [entry.split(":", 2)[2] for entry in lines if entry.startswith("0::")]
        if not unified:
            raise SystemExit("cpu_budget: no cpuacct hierarchy and no cgroup v2 to account the sandboxes with")
        self.unified = Path("/sys/fs/cgroup") / unified[0].lstrip("/") / "cpu.stat"

    def sandbox_group_seconds(self) -> float:
        if self.sandboxes is not None:
            return self.sandboxes.seconds()
        assert self.unified is not None
        usage = re.search(r"^usage_usec (\d+)", self.unified.read_text(), re.M)
        return int(usage.group(1)) / 1e6 if usage else 0.0

    def release(self) -> None:
        if self.tree is not None:
            self.tree.release()

    def snapshot(self) -> dict[str, float]:
        seconds = {name: process_seconds(pid) for name, pid in self.pids.items()}
        seconds.update({f"{name} system": system_seconds(pid) for name, pid in self.pids.items()})
        seconds["runner template"] = sum(process_seconds(pid) for pid in self.templates)
        seconds["sandbox group"] = self.sandbox_group_seconds()
        if self.tree is not None:
            seconds["tree"] = self.tree.seconds()
        seconds["machine"] = machine_seconds()
        seconds["client"] = process_seconds(os.getpid())
        return seconds

    def floor(self) -> int:
        """The pool's warm floor, as `up` gave it to the controller."""
        found = re.search(r"--pool-size (\d+)", cmdline(self.pids["controller"]))
        if found is None:
            raise SystemExit("cpu_budget: the controller's command line names no --pool-size")
        return int(found.group(1))

    def at_rest(self) -> int:
        """Settle the pool at its floor (a warm target the warm-up raised comes down first): a
        place the pool is sure to come back to, where a ready count read on the way down is not."""
        floor = self.floor()
        settle(self, floor)
        return floor

    def back_to(self, ready: int) -> None:
        settle(self, ready)


def redis_of(stack: Stack) -> Any:
    """A client of the stack's own Redis (its port and password from the config `up` wrote)."""
    import redis

    conf = (stack.up.data_dir / "redis" / "redis.conf").read_text()
    port = re.search(r"^port (\d+)", conf, re.M)
    password = re.search(r"^requirepass (\S+)", conf, re.M)
    assert port and password
    return redis.Redis(port=int(port.group(1)), password=password.group(1), decode_responses=True)


def redis_commands(stack: Stack) -> Counter[str]:
    """Calls so far by Redis command (INFO commandstats): the round trips a session costs."""
    client = redis_of(stack)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return Counter({name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()})


def pool_states(stack: Stack) -> tuple[Counter[str], int]:
    """How many of the pool's sandboxes are in each state, and how many wait in the doomed set."""
    from sandpool.state.keys import Keys

    keys = Keys()
    client = redis_of(stack)
    try:
        members = client.smembers(keys.pool_members("default"))
        states = Counter(client.hget(keys.sandbox(m), "state") for m in members)
        doomed = client.scard(keys.doomed)
    finally:
        client.close()
    stack.polled.update({"smembers": 1, "hget": len(members), "scard": 1})  # not the service's calls
    return states, doomed


def settle(stack: Stack, ready: int | None = None, timeout: float = 300.0) -> None:
    """Wait until no sandbox is starting or doomed; given `ready`, until the pool is back where it
    started (that many ready sandboxes and nothing else): a released session's teardown and the
    warm target's slow way back down to where it was (demand.py) land in the window."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states, doomed = pool_states(stack)
        quiet = doomed == 0 and states["starting"] == 0 and states["doomed"] == 0
        if quiet and (ready is None or states == Counter(ready=ready)):
            time.sleep(1.0)  # the last destroys' kernel work (namespace teardown) lands
            return
        time.sleep(0.2)
    raise SystemExit(f"cpu_budget: the pool did not settle{'' if ready is None else f' back to {ready} ready'}")


# --- the churn ----------------------------------------------------------------------------------------

async def churn(url: str, token: str | None, clients: int, sessions: int, calls: int = 5) -> dict[str, Any]:
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

def whole(before: dict[str, float], after: dict[str, float], sessions: int) -> dict[str, float]:
    """What any backend is measured by: its process tree, and the whole machine minus the load client."""
    def per(seconds: float) -> float:
        return round(seconds / sessions * 1000, 2)

    out = {"whole machine minus client": per(after["machine"] - before["machine"]
                                             - (after["client"] - before["client"])),
           "load client": per(after["client"] - before["client"])}
    if "tree" in before:
        out["process tree"] = per(after["tree"] - before["tree"])
    return out


def per_session(before: dict[str, float], after: dict[str, float], sessions: int) -> dict[str, float]:
    """sandpool's CPU per session by component, with its tree and the machine."""
    spent = {name: after[name] - before[name] for name in before}
    out = {name: round(spent[name] / sessions * 1000, 2) for name in ("api", "controller", "redis", "zygote")}
    out["control plane (api, controller, redis)"] = round(out["api"] + out["controller"] + out["redis"], 2)
    out["runner template"] = round(spent["runner template"] / sessions * 1000, 2)
    out["sandboxes (agent, interpreter, shell)"] = round(
        (spent["sandbox group"] - spent["zygote"] - spent["runner template"]) / sessions * 1000, 2)
    out["sandbox (zygote, template, its processes)"] = round(
        out["zygote"] + out["runner template"] + out["sandboxes (agent, interpreter, shell)"], 2)
    out |= whole(before, after, sessions)
    out.setdefault("process tree", round(out["control plane (api, controller, redis)"]
                                         + out["sandbox (zygote, template, its processes)"], 2))
    parts = ("api", "controller", "redis", "sandbox (zygote, template, its processes)")
    out["kernel and rest"] = round(out["whole machine minus client"] - sum(out[k] for k in parts), 2)
    for name in ("api", "controller", "redis", "zygote"):
        out[f"{name}: of which system"] = round(spent[f"{name} system"] / sessions * 1000, 2)
    return out


def table(rows: dict[str, float], title: str) -> str:
    """One figure a line, with DESIGN.md's figure beside those it gives one for."""
    width = max(len(k) for k in rows) + 2
    lines = [title, "-" * len(title)]
    for name, value in rows.items():
        budget = f"   (DESIGN: {BUDGET_MS[name]:g} ms)" if name in BUDGET_MS else ""
        lines.append(f"{name:<{width}}{value:>9.2f} ms{budget}")
    return "\n".join(lines)


class Backend(Protocol):
    """What a churn window needs of a backend: where it answers, and when it is at rest."""

    @property
    def url(self) -> str | None: ...
    @property
    def token(self) -> str | None: ...
    def at_rest(self) -> Any: ...
    def back_to(self, mark: Any) -> None: ...
    def snapshot(self) -> dict[str, float]: ...


async def churn_window(backend: Backend, args: argparse.Namespace,
                       edge: Callable[[], Any] = lambda: None) -> dict[str, Any]:
    """Warm up, then churn `--sessions` sessions in a window that opens with the backend at rest and
    closes only when it is back there: what a churn defers (teardown, refills) is counted. `edge`
    reads anything else at the window's two edges."""
    assert backend.url
    await churn(backend.url, backend.token, args.clients, args.warmup)  # caches, arenas, warm targets
    mark = backend.at_rest()
    before, opened, edges = backend.snapshot(), time.monotonic(), [edge()]
    result = await churn(backend.url, backend.token, args.clients, args.sessions)
    backend.back_to(mark)
    after = backend.snapshot()
    edges.append(edge())
    return {"churn": result, "rest": mark, "window_s": round(time.monotonic() - opened, 1),
            "before": before, "after": after, "edges": edges}


async def measure(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    assert stack.up.url and stack.up.token
    url, token = stack.up.url, stack.up.token
    report: dict[str, Any] = {"cores": os.cpu_count(), "sessions": args.sessions, "clients": args.clients}
    profiles = start_profiles(stack, args.profile, 900) if args.profile else []
    window = await churn_window(stack, args, edge=lambda: redis_commands(stack) - stack.polled)
    commands_before, commands_after = window["edges"]
    for proc in profiles:
        proc.send_signal(2)  # SIGINT: py-spy writes what it has
    for proc in profiles:
        proc.wait(60)
    result = report["churn"] = window["churn"]
    report["window_s"], report["pool_ready"] = window["window_s"], window["rest"]
    report["cpu_ms_per_session"] = per_session(window["before"], window["after"], result["sessions"])
    report["redis_calls_per_session"] = {
        name: round(calls / result["sessions"], 2)
        for name, calls in (commands_after - commands_before).most_common() if name != "info"}
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


# --- sandpool and the reference, interleaved ---------------------------------------------------------

def background(seconds: float) -> float:
    """The machine's busy CPU per second with no backend running: on a shared machine, what others
    add to the whole-machine figure for each second of a window (indicative: it moves)."""
    start = machine_seconds()
    time.sleep(seconds)
    return (machine_seconds() - start) / seconds


def charge_background(run: dict[str, Any], cores: float) -> None:
    """Put the machine's load with no backend running beside a run, as ms per session over its
    window. Context, not a correction: a busy backend displaces part of that load on a small
    machine, so subtracting it would take off more than others added."""
    run["background_cores"] = round(cores, 3)
    run["background_ms_per_session"] = round(cores * run["window_s"] / run["churn"]["sessions"] * 1000, 2)


def run_sandpool(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack(StartedUp(None, None, args.port, auth=True))
    try:
        stack.find()
        stack.account()
        window = asyncio.run(churn_window(stack, args))
    finally:
        stack.release()
        stack.up.stop()
    sessions = window["churn"]["sessions"]
    return {"churn": window["churn"], "window_s": window["window_s"], "pool_ready": window["rest"],
            "cpu_ms_per_session": per_session(window["before"], window["after"], sessions)}


def run_reference(args: argparse.Namespace) -> dict[str, Any]:
    backend = Reference(args.reference, args.reference_python, args.reference_port)
    try:
        window = asyncio.run(churn_window(backend, args))
    finally:
        backend.stop()
    return {"churn": window["churn"], "window_s": window["window_s"],
            "cpu_ms_per_session": whole(window["before"], window["after"], window["churn"]["sessions"])}


def side_by_side(args: argparse.Namespace) -> dict[str, Any]:
    """sandpool and the reference, one at a time, each started for its run and stopped after it
    (an idle backend's ticks would land in the other's window), interleaved s, r, s, r, ..."""
    runs: list[dict[str, Any]] = []
    for number in range(1, args.runs + 1):
        for name, run in (("sandpool", run_sandpool), ("reference", run_reference)):
            before = background(args.background)
            result = {"backend": name, "run": number, **run(args)}
            charge_background(result, (before + background(args.background)) / 2)  # read on both sides
            print(f"{name} {number}: {summary(result)}", flush=True)
            runs.append(result)
    return {"cores": os.cpu_count(), "sessions": args.sessions, "clients": args.clients,
            "reference": str(args.reference), "runs": runs, "ratios": ratios(runs)}


def summary(run: dict[str, Any]) -> str:
    cpu, churned = run["cpu_ms_per_session"], run["churn"]
    return (f"whole machine minus client {cpu['whole machine minus client']} ms, tree {cpu['process tree']} ms per "
            f"session; {churned['sessions']} sessions at {churned['sessions_per_s']}/s, window {run['window_s']} s "
            f"(background {run['background_ms_per_session']} ms per session), errors {churned['errors']}")


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """sandpool over the reference, pair by pair (DESIGN.md: at most 1, the tree on the way to 0.5)."""
    out = []
    for ours, theirs in zip(runs[::2], runs[1::2], strict=True):
        out.append({name: round(ours["cpu_ms_per_session"][name] / theirs["cpu_ms_per_session"][name], 2)
                    for name in BUDGET_RATIO})
    return out


def side_by_side_table(report: dict[str, Any]) -> str:
    runs = report["runs"]
    heads = [f"{run['backend'][0]}{run['run']}" for run in runs]
    rows: list[tuple[str, list[Any]]] = [
        (name, [run["cpu_ms_per_session"].get(name, "") for run in runs])
        for name in ("whole machine minus client", "process tree", "load client", "api", "controller", "redis",
                     "control plane (api, controller, redis)", "sandbox (zygote, template, its processes)")]
    rows += [("background (ms/session over the window)", [run["background_ms_per_session"] for run in runs]),
             ("window (s)", [run["window_s"] for run in runs]),
             ("sessions/s", [run["churn"]["sessions_per_s"] for run in runs]),
             ("errors, dropped", [f"{run['churn']['errors']}, {sum(run['churn']['dropped_connections'].values())}"
                                  for run in runs])]
    width = max(len(name) for name, _ in rows) + 2
    title = (f"CPU per churned session in ms, sandpool (s) and the reference (r) interleaved "
             f"({report['sessions']} sessions, {report['clients']} clients, {report['cores']} cores)")
    lines = [title, "-" * len(title), f"{'':<{width}}" + "".join(f"{h:>10}" for h in heads)]
    lines += [f"{name:<{width}}" + "".join(f"{v:>10}" for v in values) for name, values in rows]
    lines.append("")
    for number, pair in enumerate(report["ratios"], 1):
        lines.append(f"pair {number}, sandpool / reference: " + ", ".join(f"{k} {v}" for k, v in pair.items()))
    lines.append("DESIGN.md: " + "; ".join(
        f"{name} at most {most:g} x the reference's" + (f" (goal {goal:g} x)" if goal else "")
        for name, (most, goal) in BUDGET_RATIO.items()))
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------------------

def arguments() -> argparse.Namespace:
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
    side = parser.add_argument_group("side by side with the reference backend (the churn only)")
    side.add_argument("--reference", type=Path, default=None, metavar="CHECKOUT",
                      help="a checkout of otari-sandbox-container: churn it and sandpool, interleaved")
    side.add_argument("--reference-python", default="python3",
                      help="a Python with the reference's dependencies (fastapi, uvicorn, ...)")
    side.add_argument("--reference-port", type=int, default=18190, help="port of the reference started")
    side.add_argument("--runs", type=int, default=3, help="pairs of runs (sandpool, then the reference)")
    side.add_argument("--background", type=float, default=3.0,
                      help="seconds of the machine's load read before and after each run, no backend running")
    args = parser.parse_args()
    if args.reference is not None and args.profile is not None:
        parser.error("--profile is for sandpool alone")
    return args


def main() -> int:
    args = arguments()
    if os.geteuid() != 0:
        raise SystemExit("cpu_budget: run as root (cgroup accounting, the zygote's isolation, py-spy)")
    if args.reference is not None:
        report = side_by_side(args)
        print("\n" + side_by_side_table(report))
        return _write(report, args.json)
    stack = Stack(StartedUp(None, None, args.port, auth=True))
    try:
        stack.find()
        stack.account()
        report = asyncio.run(measure(stack, args))
    finally:
        stack.release()
        stack.up.stop()
    print(table(report["cpu_ms_per_session"], f"CPU per churned session ({report['churn']['sessions']} sessions, "
                                              f"{args.clients} clients, {report['cores']} cores, window "
                                              f"{report['window_s']} s back to {report['pool_ready']} ready)"))
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
