"""Smoke test of a running control plane (api, controller, Redis), as a client and a scraper see it.

Runs inside the control-plane image on the host network:

    python control_plane_smoke.py API_URL CONTROLLER_URL TOKEN_FILE

A session goes through the api with the project's own client (CreateSession,
Execute, DestroySession), with a token minted by the image's `sandpool token`;
both services must answer /readyz and /metrics: the api its request and
execution counters, the controller its pool gauges and its leadership. Every
check prints one line; the first failure ends the run with exit 1.
"""

from __future__ import annotations

import sys
import time

import httpx

from sandpool.client import Client, NotFound


class SmokeFailure(Exception):
    pass


def check(ok: bool, what: str, detail: object = "") -> None:
    if not ok:
        raise SmokeFailure(f"{what}: {detail}")
    print(f"images: control plane ok: {what}", flush=True)


def wait_ready(http: httpx.Client, url: str, timeout: float = 120.0) -> float:
    start = time.monotonic()
    last = "no answer"
    while time.monotonic() - start < timeout:
        try:
            resp = http.get(f"{url}/readyz", timeout=2)
            if resp.status_code == 200:
                return time.monotonic() - start
            last = f"{resp.status_code} {resp.text[:200]}"
        except httpx.TransportError as exc:
            last = type(exc).__name__
        time.sleep(0.25)
    raise SmokeFailure(f"{url}/readyz not 200 within {timeout:.0f} s (last: {last})")


def metric_total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def smoke(api: str, controller: str, token: str) -> None:
    with httpx.Client(trust_env=False) as http:
        for name, url in (("controller", controller), ("api", api)):
            waited = wait_ready(http, url)
            check(True, f"{name} /readyz answers 200 (after {waited:.1f} s)")

        refused = http.post(f"{api}/sessions", json={})
        check(refused.status_code == 401, "CreateSession without a token is refused (401)", refused.status_code)

        with Client(api, token=token, http_client=http) as client:
            session = client.create_session()
            with session:
                check(bool(session.id), f"CreateSession through the api ({session.id})")
                result = session.run_python("print(1)")
                check((result.stdout, result.return_code) == ("1\n", 0), "Execute print(1) prints 1",
                      (result.stdout, result.stderr, result.return_code))
                result = session.run_bash("echo $((6 * 7))")
                check(result.stdout == "42\n", "Execute in bash", (result.stdout, result.stderr))
            try:
                client.attach(session.id).run_python("print(2)")
            except NotFound:
                check(True, "DestroySession: the session is gone afterwards (404)")
            else:
                raise SmokeFailure("the session still runs code after DestroySession")

        # A sandbox was started and leased, so the one controller leads the pools.
        checks = http.get(f"{controller}/readyz").json().get("checks", {})
        check(checks.get("controller") == "leader", "the controller leads the pools", checks)
        scraped = http.get(f"{api}/metrics")
        check(scraped.status_code == 200 and "sandpool_requests_total" in scraped.text,
              "api /metrics answers with sandpool's request metrics", scraped.status_code)
        executions = metric_total(scraped.text, "sandpool_executions_total")
        check(executions >= 2, f"the api counted the executions ({executions:.0f})", executions)
        scraped = http.get(f"{controller}/metrics")
        ceiling = metric_total(scraped.text, "sandpool_pool_ceiling", pool="default")
        check(scraped.status_code == 200 and ceiling >= 1,
              f"controller /metrics answers with the pool gauges (ceiling {ceiling:.0f})", scraped.status_code)


def main() -> int:
    api, controller, token_file = sys.argv[1:4]
    with open(token_file) as fh:
        token = fh.read().strip()
    try:
        smoke(api.rstrip("/"), controller.rstrip("/"), token)
    except (SmokeFailure, httpx.HTTPError) as exc:
        print(f"images: control plane FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - any client error is a failed smoke test, said in one line
        print(f"images: control plane FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
