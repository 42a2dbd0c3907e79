"""A steady create / execute / destroy load on a sandpool URL, every answer recorded with its time.

Each client loops: CreateSession, `print(1)` a few times, DestroySession. A failed create is tried
again; a session whose calls fail is destroyed (retried until Redis answers again) before the
next, so every session a client was given is ended by it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

PRINT_1 = {"tool": "code_execution", "input": {"code": "print(1)"}}


@dataclass
class Answer:
    at: float
    """time.monotonic() when the answer (or the failure) came."""
    op: str
    ok: bool
    status: int


@dataclass
class Load:
    url: str
    token: str
    clients: int = 4
    calls_per_session: int = 3
    answers: list[Answer] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        for i in range(self.clients):
            thread = threading.Thread(target=self._client, name=f"load-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self._threads), "a load client never finished"

    def _record(self, op: str, response: httpx.Response | None, ok_status: int) -> bool:
        status = response.status_code if response is not None else 0
        with self._lock:
            self.answers.append(Answer(time.monotonic(), op, status == ok_status, status))
        return status == ok_status

    def _send(self, client: httpx.Client, method: str, path: str, **kwargs: object) -> httpx.Response | None:
        try:
            return client.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError:
            return None

    def _client(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=30, trust_env=False) as client:
            while not self._stop.is_set():
                created = self._send(client, "POST", "/sessions", json={"idle_timeout_seconds": 5})
                if not self._record("create", created, 201):
                    time.sleep(0.02)
                    continue
                assert created is not None
                session = created.json()["session_id"]
                with self._lock:
                    self.created.append(session)
                for _ in range(self.calls_per_session):
                    answered = self._send(client, "POST", f"/sessions/{session}/exec", json=PRINT_1)
                    if not self._record("exec", answered, 200):
                        break
                while True:  # end it, whatever happened: a session given to this client is its to end
                    ended = self._send(client, "DELETE", f"/sessions/{session}")
                    if self._record("destroy", ended, 204) or self._stop.is_set() and ended is not None:
                        break
                    time.sleep(0.05)

    def executions_answered(self, *, since: float = float("-inf"), until: float = float("inf")) -> int:
        return sum(1 for a in self.answers if a.op == "exec" and a.ok and since <= a.at < until)

    def failures(self, *, since: float = float("-inf")) -> list[Answer]:
        return [a for a in self.answers if not a.ok and a.at >= since]
