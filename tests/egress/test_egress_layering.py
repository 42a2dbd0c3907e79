"""The egress proxy stands alone: it talks to Redis only through `sandpool.state`, and to no other service."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "services" / "sandpool"
FORBIDDEN = ("redis", "kubernetes", "fastapi", "sandpool.sessions", "sandpool.edge", "sandpool.agent",
             "sandpool.controller", "sandpool.providers", "sandpool.client", "sandpool.up")


def test_egress_imports_no_other_service_and_no_redis() -> None:
    bad = []
    for path in sorted((ROOT / "egress").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            bad += [f"{path.name} imports {n}" for n in names
                    if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == []


def test_the_state_layer_does_not_import_the_egress_proxy() -> None:
    text = (ROOT / "state" / "egress.py").read_text()
    assert "sandpool.egress" not in text
