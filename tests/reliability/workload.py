"""A bounded client workload: threads cycling sessions (create, each tool kind, files, destroy).

It records everything the invariants need: every session id and the sandbox it
was leased (read from Redis right after the lease), every answer's status, and
every request that failed without an answer. Loops are bounded in count and
time and stop on their own.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis

from sandpool.state.keys import Keys

EXECS = [
    {"tool": "code_execution", "input": {"code": "print(sum(range(10)))"}},
    {"tool": "bash_code_execution", "input": {"command": "echo $((6*7)) > out.txt; cat out.txt"}},
    {"tool": "text_editor_code_execution", "input": {"command": "create", "path": "notes.txt", "file_text": "a\nb\n"}},
    {"tool": "text_editor_code_execution", "input": {"command": "view", "path": "notes.txt"}},
]
EXPECTED_STDOUT = {0: "45\n", 1: "42\n"}
RETRYABLE = (503, 429)


@dataclass
class Record:
    created: list[str] = field(default_factory=list)             # 201 seen by a client
    sandboxes: dict[str, str] = field(default_factory=dict)      # session -> sandbox (from Redis)
    destroyed: list[str] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)      # "op status"
    transport_errors: Counter[str] = field(default_factory=Counter)
    create_transport_errors: int = 0                             # creates whose outcome is unknown
    bad: list[str] = field(default_factory=list)                 # answers no invariant allows
    executions: Counter[str] = field(default_factory=Counter)    # 200s per tool
    gone: set[str] = field(default_factory=set)                  # sessions seen 404 (cleanly gone)
    destroy_sent: set[str] = field(default_factory=set)          # DELETE sent (204 or not: see `destroyed`)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Workload:
    def __init__(self, urls: list[str], keys: Keys, redis_client_factory: Any, *, headers: dict[str, str] | None = None,
                 threads: int = 3, sessions: int = 100, calls_per_session: int = 1, deadline_s: float = 600,
                 allowed_5xx: tuple[str, ...] = ("at_capacity", "redis_unavailable", "sandbox_unavailable",
                                                 "sandbox_failed", "unavailable"),
                 files_every: int = 1, request_timeout: float = 30) -> None:
        self.urls = urls
        self.keys = keys
        self.redis_factory = redis_client_factory
        self.headers = headers or {}
        self.threads = threads
        self.sessions = sessions
        self.rounds = calls_per_session
        self.deadline = time.monotonic() + deadline_s
        self.allowed_5xx = allowed_5xx
        self.files_every = files_every  # upload/download/list in every n-th session
        self.timeout = request_timeout
        self.record = Record()
        self.stop = threading.Event()
        self._issued = 0
        self._workers: list[threading.Thread] = []

    # --- running -----------------------------------------------------------------------------
    def start(self) -> Workload:
        for i in range(self.threads):
            worker = threading.Thread(target=self._run, args=(i,), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def join(self, timeout: float = 900) -> Record:
        for worker in self._workers:
            worker.join(max(0.0, timeout))
        assert not any(w.is_alive() for w in self._workers), "the workload did not finish (a hang?)"
        return self.record

    def done_sessions(self) -> int:
        with self.record.lock:
            return len(self.record.destroyed) + len(self.record.gone)

    def _next(self) -> bool:
        with self.record.lock:
            if self._issued >= self.sessions or self.stop.is_set() or time.monotonic() > self.deadline:
                return False
            self._issued += 1
            return True

    def _run(self, index: int) -> None:
        clients = [httpx.Client(base_url=url, headers=self.headers, timeout=self.timeout) for url in self.urls]
        try:
            turn = index
            with self.redis_factory() as rdb:
                while self._next():
                    turn += 1
                    self._cycle(clients, turn, rdb)
        finally:
            for client in clients:
                client.close()

    # --- one session ---------------------------------------------------------------------------
    def _note(self, op: str, response: httpx.Response) -> None:
        with self.record.lock:
            self.record.statuses[f"{op} {response.status_code}"] += 1
            if response.status_code >= 500:
                try:
                    reason = response.json().get("reason")
                except ValueError:
                    reason = None
                if op == "create" and reason == "redis_unavailable":
                    # Redis may have run the lease and died before replying: the session may exist.
                    self.record.create_transport_errors += 1
                if reason not in self.allowed_5xx:
                    self.record.bad.append(f"{op} {response.status_code} {response.text[:200]}")
            elif response.status_code >= 400 and response.status_code not in (404, 429):
                self.record.bad.append(f"{op} {response.status_code} {response.text[:200]}")

    def _call(self, clients: list[httpx.Client], turn: int, op: str, method: str, url: str,
              **kwargs: Any) -> httpx.Response | None:
        # Round-robin over the given addresses (replicas); a transport error tries the next one.
        for attempt in range(len(clients)):
            client = clients[(turn + attempt) % len(clients)]
            try:
                response = client.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                with self.record.lock:
                    self.record.transport_errors[f"{op} {type(exc).__name__}"] += 1
                    if op == "create" and not isinstance(exc, httpx.ConnectError):
                        self.record.create_transport_errors += 1
                if op == "create" and not isinstance(exc, httpx.ConnectError):
                    return None  # it may have leased before the answer was lost: never retried blindly
                continue  # refused before anything was sent: the next address may serve it
            self._note(op, response)
            return response
        return None

    def _cycle(self, clients: list[httpx.Client], turn: int, rdb: Any) -> None:
        response = None
        for _ in range(200):  # bounded: at capacity / quota, wait and retry
            response = self._call(clients, turn, "create", "POST", "/sessions", json={})
            if response is None or response.status_code not in RETRYABLE or self.stop.is_set():
                break
            time.sleep(0.02)
        if response is None or response.status_code != 201:
            return
        sid = response.json()["session_id"]
        with self.record.lock:
            self.record.created.append(sid)
        try:  # which sandbox it got, for the leased-twice check (Redis may be the fault right now)
            sandbox = rdb.hget(self.keys.session(sid), "sandbox")
        except redis.RedisError:
            sandbox = None
        if sandbox:
            with self.record.lock:
                self.record.sandboxes[sid] = sandbox
        for _ in range(self.rounds):
            for i, body in enumerate(EXECS):
                r = self._call(clients, turn, "exec", "POST", f"/sessions/{sid}/exec", json=body)
                if r is None:
                    continue
                if r.status_code == 404:
                    self._gone(sid)
                    return
                if r.status_code == 200:
                    content = r.json()["result_block"]["content"]
                    if i in EXPECTED_STDOUT and content["stdout"] != EXPECTED_STDOUT[i]:
                        with self.record.lock:
                            self.record.bad.append(f"exec wrong output {content}")
                    with self.record.lock:
                        self.record.executions[body["tool"]] += 1
            if turn % self.files_every == 0:
                r = self._call(clients, turn, "put", "POST", f"/sessions/{sid}/files",
                               files={"file": ("data.bin", b"x" * 1000)})
                if r is not None and r.status_code == 404:
                    self._gone(sid)
                    return
                r = self._call(clients, turn, "get", "GET", f"/sessions/{sid}/files", params={"path": "out.txt"})
                if r is not None and r.status_code == 200 and r.content != b"42\n":
                    with self.record.lock:
                        self.record.bad.append(f"get wrong content {r.content[:100]!r}")
                r = self._call(clients, turn, "list", "GET", f"/sessions/{sid}/files/list")
        with self.record.lock:  # from here on a fault may end it with its answer lost: gone is fine
            self.record.destroy_sent.add(sid)
        r = self._call(clients, turn, "destroy", "DELETE", f"/sessions/{sid}")
        if r is not None and r.status_code == 204:
            with self.record.lock:
                self.record.destroyed.append(sid)

    def _gone(self, sid: str) -> None:
        with self.record.lock:
            self.record.gone.add(sid)
