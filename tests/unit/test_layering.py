"""Dependencies point one way: the arrows in docs/architecture.md, checked on the source.

- `contract` imports no service (nor Redis, Kubernetes, an HTTP client);
- the agent imports nothing of the control plane (nor Redis, Kubernetes): it runs in the sandbox;
- the edge (auth, tenancy, policy, admin API) reaches nothing of the controller, the providers or
  the agent; of the session layer it shares only the api's metrics (`sessions.metrics`); it uses
  the egress proxy's allow-list parser to check a workspace's list;
- the session layer (leases, forwarding, streaming) imports neither the edge, the agent, the
  egress proxy nor a provider; of the controller package it reads only the pool configuration
  (`controller.pools`, `controller.provider`'s PoolSpec), never the controller itself;
- the controller (pool controller, session reaper, provider) imports neither the session layer,
  the edge, the api, the agent nor the egress proxy: it shares only Redis with the api;
- the api composes the edge and the session layer and runs neither the controller nor a provider
  (checked on the imports and on what an api process loads);
- the egress proxy imports no other service (it shares only Redis, through `state`);
- only the Kubernetes provider imports `kubernetes`; only `state/` imports `redis` (every Redis
  record and script lives there);
- nothing reaches into the edge but the api, which composes it, `sandpool up`, which checks its
  keys before it starts anything, and the command line (keygen, token).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services" / "sandpool"


def imports_of(package: str) -> dict[Path, set[str]]:
    found: dict[Path, set[str]] = {}
    paths = sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else [ROOT / f"{package}.py"]
    for path in paths:
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[path] = names
    return found


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def offenders(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    """Imports of `package` under a `forbidden` prefix and not under an `allowed` one."""
    bad = []
    for path, names in imports_of(package).items():
        for name in names:
            if _under(name, forbidden) and not _under(name, allowed):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return sorted(bad)


SERVICES = ("sandpool.agent", "sandpool.api", "sandpool.sessions", "sandpool.controller", "sandpool.providers",
            "sandpool.edge", "sandpool.egress", "sandpool.up", "sandpool.state", "sandpool.client")
CONTROL_PLANE = tuple(s for s in SERVICES if s != "sandpool.agent")
POOL_CONFIGURATION = ("sandpool.controller.pools", "sandpool.controller.provider")


@pytest.mark.parametrize(
    ("package", "forbidden", "allowed"),
    [
        ("contract", SERVICES + ("redis", "kubernetes", "httpx"), ()),
        ("agent", CONTROL_PLANE + ("redis", "kubernetes"), ()),
        ("edge", ("sandpool.sessions", "sandpool.controller", "sandpool.providers", "sandpool.agent", "sandpool.api",
                  "sandpool.up", "kubernetes"), ("sandpool.sessions.metrics",)),
        ("sessions", ("sandpool.edge", "sandpool.agent", "sandpool.egress", "sandpool.providers", "sandpool.api",
                      "sandpool.up", "sandpool.controller", "kubernetes"), POOL_CONFIGURATION),
        ("controller", ("sandpool.sessions", "sandpool.edge", "sandpool.api", "sandpool.agent", "sandpool.egress",
                        "sandpool.up", "kubernetes"), ()),
        ("api", ("sandpool.controller", "sandpool.providers", "sandpool.agent", "sandpool.egress", "sandpool.up",
                 "kubernetes"), ()),
        ("egress", tuple(s for s in SERVICES if s not in ("sandpool.egress", "sandpool.state"))
         + ("redis", "kubernetes", "fastapi"), ()),
        ("state", tuple(s for s in SERVICES if s != "sandpool.state") + ("kubernetes",), ()),
        ("client", tuple(s for s in SERVICES if s != "sandpool.client") + ("redis", "kubernetes"), ()),
    ],
)
def test_dependency_arrows(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    assert (ROOT / package).is_dir()
    assert offenders(package, forbidden, allowed) == []


def test_the_api_composes_the_edge_and_the_session_layer() -> None:
    """The arrow the api exists for: it imports both (were it to lose one, the rules above say nothing)."""
    names = set().union(*imports_of("api").values())
    assert any(_under(n, ("sandpool.edge",)) for n in names)
    assert any(_under(n, ("sandpool.sessions",)) for n in names)


def _loaded_by(module: str, prefixes: tuple[str, ...]) -> list[str]:
    code = (f"import sys, {module}\n"
            f"print('\\n'.join(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.split()


def test_an_api_process_loads_no_pool_controller_and_no_provider() -> None:
    loaded = _loaded_by("sandpool.api.app", ("sandpool.providers", "sandpool.controller.", "sandpool.agent",
                                             "sandpool.up", "kubernetes"))
    assert sorted(set(loaded) - set(POOL_CONFIGURATION)) == []


def test_a_controller_process_loads_no_edge_no_session_layer_and_no_api() -> None:
    loaded = _loaded_by("sandpool.controller.app", ("sandpool.edge", "sandpool.sessions", "sandpool.api",
                                                    "sandpool.egress", "sandpool.agent", "sandpool.up"))
    assert loaded == []


def _packages() -> list[str]:
    return [p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("_")]


def _modules() -> list[str]:
    """Every package, and every module at the top (cli.py, configref.py, ...)."""
    return _packages() + [p.stem for p in ROOT.glob("*.py") if not p.name.startswith("_")]


def test_only_the_kubernetes_provider_imports_kubernetes() -> None:
    bad = [line for package in _modules() for line in offenders(package, ("kubernetes",))
           if not line.startswith("providers/kubernetes/")]
    assert bad == []


def test_only_state_imports_redis() -> None:
    bad = [line for package in _modules() if package != "state" for line in offenders(package, ("redis",))]
    assert bad == []


def test_nothing_but_the_api_up_and_the_command_line_imports_the_edge() -> None:
    # The command line names `sandpool.edge.keys_cli` (keygen, token) as a string it imports lazily;
    # `sandpool up` checks the api's keys before it starts anything (a one-line failure).
    launchers = ("edge", "api", "up", "cli")
    bad = [line for package in _modules() if package not in launchers
           for line in offenders(package, ("sandpool.edge",))]
    assert bad == []
