"""Dependencies point one way: the arrows in docs/architecture.md, checked on the source.

- `contract` imports nothing from the services;
- the agent imports neither Redis, Kubernetes, nor any control-plane package;
- the proxy and the scheduler never import each other (they talk over HTTP);
- the egress proxy imports no other service (it shares only Redis, through `state`);
  the proxy uses its allow-list parser to check a workspace's list;
- the pool controller never imports the scheduler (the scheduler runs it, not the reverse);
- only the Kubernetes provider imports `kubernetes`; only `state/` imports `redis` (every Redis
  record and script lives there);
- nothing reaches into the proxy but the command line and `sandpool up`, which start it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services" / "sandpool"


def imports_of(package: str) -> dict[Path, set[str]]:
    found: dict[Path, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[path] = names
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path, names in imports_of(package).items():
        for name in names:
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


SERVICES = ("sandpool.agent", "sandpool.sessions", "sandpool.controller", "sandpool.providers", "sandpool.edge",
            "sandpool.egress", "sandpool.state", "sandpool.client")


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("contract", SERVICES + ("redis", "kubernetes", "httpx")),
        ("agent", tuple(s for s in SERVICES if s != "sandpool.agent") + ("redis", "kubernetes")),
        ("proxy", ("sandpool.sessions", "sandpool.controller", "sandpool.providers", "sandpool.agent", "kubernetes")),
        ("scheduler", ("sandpool.edge", "sandpool.agent", "sandpool.egress", "kubernetes")),
        ("pool", ("sandpool.sessions", "sandpool.edge", "sandpool.agent", "sandpool.egress", "kubernetes")),
        ("egress", tuple(s for s in SERVICES if s not in ("sandpool.egress", "sandpool.state"))
         + ("redis", "kubernetes", "fastapi")),
        ("state", SERVICES[:-2] + ("kubernetes",)),
        ("client", tuple(s for s in SERVICES if s != "sandpool.client") + ("redis", "kubernetes")),
    ],
)
def test_dependency_arrows(package: str, forbidden: tuple[str, ...]) -> None:
    assert (ROOT / package).is_dir()
    assert offenders(package, forbidden) == []


def test_only_the_kubernetes_provider_imports_kubernetes() -> None:
    bad = []
    for package in [p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("_")]:
        for line in offenders(package, ("kubernetes",)):
            if not line.startswith("providers/kubernetes/"):
                bad.append(line)
    assert bad == []


def _packages() -> list[str]:
    return [p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("_")]


def test_only_state_imports_redis() -> None:
    bad = [line for package in _packages() if package != "state" for line in offenders(package, ("redis",))]
    assert bad == []


def test_nothing_but_the_launchers_imports_the_proxy() -> None:
    # `sandpool up` checks the proxy's keys before it starts anything (a one-line failure).
    launchers = ("proxy", "up")
    bad = [line for package in _packages() if package not in launchers
           for line in offenders(package, ("sandpool.edge",))]
    assert bad == []
