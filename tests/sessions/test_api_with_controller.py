"""The api beside `sandpool controller` and the real local provider, sharing only Redis: warm, lease,
replace; each process's probes and metrics say what is its own."""

from __future__ import annotations

import httpx
import pytest
from testkit import wait_for

pytest.importorskip("sandpool.controller.controller")
pytest.importorskip("sandpool.providers.local.provider")


def test_controller_keeps_the_pool_warm_and_replaces_released_sandboxes(api, controller, r, keys) -> None:
    pools = {"pool_size": 1, "max_sandboxes": 2}
    ctl = controller(**pools)
    app = api(**pools)
    wait_for(lambda: httpx.get(ctl.url + "/readyz").status_code == 200, timeout=20, what="controller ready")
    assert httpx.get(ctl.url + "/readyz").json() == {"status": "ready",
                                                     "checks": {"redis": "ok", "controller": "leader"}}
    assert httpx.get(app.url + "/readyz").json() == {"status": "ready", "checks": {"redis": "ok"}}
    wait_for(lambda: r.llen(keys.pool_ready("default")) == 1, timeout=30, what="a warm sandbox")
    resp = httpx.post(app.url + "/sessions", timeout=10)
    assert resp.status_code == 201, resp.text
    sid = resp.json()["session_id"]
    first = r.hget(keys.session(sid), "sandbox")
    out = httpx.post(f"{app.url}/sessions/{sid}/exec", timeout=30,
                     json={"tool": "code_execution", "input": {"code": "print(6*7)"}})
    assert out.status_code == 200 and out.json()["result_block"]["content"]["stdout"] == "42\n"
    # The pools' gauges are the controller's, read from Redis when scraped.
    wait_for(lambda: r.llen(keys.pool_ready("default")) == 1, timeout=30, what="the pool topped up after the lease")
    text = httpx.get(ctl.url + "/metrics").text
    assert 'sandpool_pool_sandboxes{pool="default",state="ready"} 1.0' in text
    assert 'sandpool_pool_sandboxes{pool="default",state="leased"} 1.0' in text
    assert 'sandpool_pool_ceiling{pool="default"} 2.0' in text
    assert "sandpool_sandbox_start_seconds_count" in text
    assert "sandpool_leases_total" not in text  # the api's
    assert httpx.delete(f"{app.url}/sessions/{sid}").status_code == 204
    # The released sandbox is destroyed (never reused) and the pool is topped up again.
    wait_for(lambda: not r.exists(keys.sandbox(first)), timeout=30, what="released sandbox destroyed")
    wait_for(lambda: r.llen(keys.pool_ready("default")) == 1, timeout=30, what="pool topped up")
    assert first not in r.lrange(keys.pool_ready("default"), 0, -1)
    assert 'sandpool_leases_total{outcome="granted"} 1.0' in httpx.get(app.url + "/metrics").text


def test_the_controller_reaps_an_idle_session_of_the_api(api, controller, r, keys) -> None:
    pools = {"pool_size": 1, "max_sandboxes": 2}
    ctl = controller(**pools)
    app = api(**pools)
    wait_for(lambda: r.llen(keys.pool_ready("default")) == 1, timeout=30, what="a warm sandbox")
    sid = httpx.post(app.url + "/sessions", json={"idle_timeout_seconds": 1}, timeout=10).json()["session_id"]
    sandbox = r.hget(keys.session(sid), "sandbox")
    wait_for(lambda: not r.exists(keys.session(sid)), timeout=15, what="idle reap")
    assert httpx.get(f"{app.url}/sessions/{sid}").status_code == 404
    wait_for(lambda: not r.exists(keys.sandbox(sandbox)), timeout=30, what="its sandbox destroyed")
    assert 'sandpool_sessions_reaped_total{reason="idle"} 1.0' in httpx.get(ctl.url + "/metrics").text
