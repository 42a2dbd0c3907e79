"""The scheduler with its pool controller and the real local provider: warm, lease, replace."""

from __future__ import annotations

import httpx
import pytest
from testkit import wait_for

pytest.importorskip("sandpool.controller.controller")
pytest.importorskip("sandpool.providers.local.provider")



def test_controller_keeps_the_pool_warm_and_replaces_released_sandboxes(data_dir, scheduler, r, keys) -> None:
    # data_dir first: it is torn down after the app (and its controller) stopped.
    app = scheduler(controller=True, pool_size=1, max_sandboxes=2, data_dir=data_dir)
    wait_for(lambda: httpx.get(app.url + "/readyz").status_code == 200, timeout=20, what="ready")
    assert httpx.get(app.url + "/readyz").json()["checks"] == {"redis": "ok", "controller": "ok"}
    wait_for(lambda: r.llen(keys.pool_ready("default")) == 1, timeout=30, what="a warm sandbox")
    resp = httpx.post(app.url + "/sessions", timeout=10)
    assert resp.status_code == 201, resp.text
    sid = resp.json()["session_id"]
    first = r.hget(keys.session(sid), "sandbox")
    out = httpx.post(f"{app.url}/sessions/{sid}/exec", timeout=30,
                     json={"tool": "code_execution", "input": {"code": "print(6*7)"}})
    assert out.status_code == 200 and out.json()["result_block"]["content"]["stdout"] == "42\n"
    assert httpx.delete(f"{app.url}/sessions/{sid}").status_code == 204
    # The released sandbox is destroyed (never reused) and the pool is topped up again.
    wait_for(lambda: not r.exists(keys.sandbox(first)), timeout=30, what="released sandbox destroyed")
    wait_for(lambda: r.llen(keys.pool_ready("default")) == 1, timeout=30, what="pool topped up")
    assert first not in r.lrange(keys.pool_ready("default"), 0, -1)
    text = httpx.get(app.url + "/metrics").text
    assert "sandpool_sandbox_start_seconds_count" in text
