"""The runner template's source is runner.py's followed by runner_template.py's, in one module:
a name the template defined again would replace the runner's own (a `_reap` once did, and the
runner's reaping of the processes the process cap killed called the template's)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from sandpool.agent.interpreter import RUNNER, TEMPLATE, template_source


def top_level_names(path: Path) -> tuple[set[str], set[str]]:
    """(names a module's top level defines or assigns, modules it imports under their own name)."""
    defined, imported = set(), set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names if alias.asname is None and "." not in alias.name)
    return defined, imported


def test_the_template_redefines_nothing_of_the_runner() -> None:
    (runner, _), (template, template_imports) = top_level_names(RUNNER), top_level_names(TEMPLATE)
    # Importing a module binds it under its own name, the same object whoever imports it; a
    # function, class or constant of the same name as the runner's would replace the runner's.
    assert runner & template <= {"TYPE_CHECKING"}, runner & template
    assert not template_imports & runner, template_imports & runner


def test_the_template_source_neither_serves_nor_starts_without_its_option() -> None:
    # Run as a runner would be (no --template): the template's entry point must stay quiet and
    # the runner's must run (it fails on the missing descriptors, as a runner with none would).
    result = subprocess.run([sys.executable, "-I", "-S", "-c", template_source(), "--preimport", "x"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "_template" not in result.stderr and "ValueError" in result.stderr, result.stderr
