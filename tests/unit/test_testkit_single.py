"""One copy of each test helper: what tests/testkit.py provides is defined nowhere else under tests/.

`free_port` once existed ten times and `wait_for` six, each a little different (timeouts, what a
failure said). The sources are read with `ast`, not imported, so a copy fails here whatever it
does. A second definition is a function or class by a kit name (leading underscores ignored) that
is not a method, or one with a kit function's very body under another name; a subclass of a kit
class takes a name of its own (`class ServedApp(ThreadServer)`), so that a name means one thing.
A kit name imported from another test module (a harness passing it on) counts too: it hides
where the helper lives.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
KIT = TESTS / "testkit.py"
# The primitives that were copied most: never even a method by these names.
POLLERS = {"free_port", "wait_for", "eventually"}


def kit_definitions() -> tuple[set[str], dict[str, str]]:
    """The kit's public names, and the body of each of its functions (docstring left out) by name."""
    tree = ast.parse(KIT.read_text(), str(KIT))
    names: set[str] = set()
    bodies: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            names.add(node.name)
            if not isinstance(node, ast.ClassDef):
                bodies[body_shape(node)] = node.name
    return names, bodies


def body_shape(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return "\n".join(ast.dump(statement) for statement in body)


def local_modules() -> set[str]:
    return {path.stem for path in TESTS.rglob("*.py")} - {"testkit"}


def second_copies(source: str, where: str, names: set[str], bodies: dict[str, str], modules: set[str]) -> list[str]:
    """Every place in `source` that defines again, or passes on, what the kit provides."""
    found = []
    tree = ast.parse(source, where)
    methods = {id(item) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for item in node.body}
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name.lstrip("_")
            if id(node) in methods:
                if name in POLLERS:
                    found.append(f"{line} method {node.name}: use testkit.{name}")
            elif isinstance(node, ast.ClassDef):
                if name in names:
                    found.append(f"{line} class {node.name}: testkit.{name} exists "
                                 "(a subclass takes a name of its own)")
            elif name in names:
                found.append(f"{line} def {node.name}: testkit.{name} exists")
            elif body_shape(node) in bodies:
                found.append(f"{line} def {node.name}: the body of testkit.{bodies[body_shape(node)]}")
        elif isinstance(node, ast.Assign) and node in tree.body:
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.lstrip("_") in names:
                    found.append(f"{line} {target.id} = ...: testkit.{target.id.lstrip('_')} exists")
        elif isinstance(node, ast.ImportFrom) and node.module != "testkit":
            local = node.level > 0 or (node.module or "").split(".")[-1] in modules
            for alias in node.names:
                if local and alias.name in names:
                    found.append(f"{line} imports {alias.name} from {'.' * node.level}{node.module or ''}: "
                                 f"import it from testkit")
    return found


def test_the_kit_provides_the_primitives() -> None:
    names, bodies = kit_definitions()
    assert POLLERS | {"AgentProcess", "ThreadServer", "wait_http", "scrubbed_env"} <= names
    assert "free_port" in bodies.values() and "wait_for" in bodies.values()


def test_nothing_under_tests_defines_a_kit_helper_again() -> None:
    names, bodies = kit_definitions()
    modules = local_modules()
    sources = sorted(path for path in TESTS.rglob("*.py") if path != KIT and ".venv" not in path.parts)
    assert len(sources) > 100  # the whole tree was read, not an empty glob
    found = [copy for path in sources
             for copy in second_copies(path.read_text(), str(path.relative_to(TESTS)), names, bodies, modules)]
    assert found == [], "defined again outside tests/testkit.py:\n" + "\n".join(found)


PLANTED = '''
import socket
from asyncio import wait_for as asyncio_wait_for
from sp_harness import wait_for
from testkit import ThreadServer, free_port
import testkit

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def pick_a_port() -> int:
    """Renamed, docstring changed: the kit's very body all the same."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

class Up:
    def wait_for(self, prefix): ...
    def log_tail(self): ...

class ServedApp(testkit.ThreadServer): ...
class ThreadServer(testkit.ThreadServer): ...

def fixture():
    def eventually(check): ...
'''


def test_the_check_finds_planted_copies_and_spares_what_is_no_copy() -> None:
    names, bodies = kit_definitions()
    found = second_copies(PLANTED, "planted.py", names, bodies, {"sp_harness"})
    assert sorted(found) == sorted([
        "planted.py:4 imports wait_for from sp_harness: import it from testkit",
        "planted.py:8 def _free_port: testkit.free_port exists",
        "planted.py:13 def pick_a_port: the body of testkit.free_port",
        "planted.py:20 method wait_for: use testkit.wait_for",
        "planted.py:24 class ThreadServer: testkit.ThreadServer exists (a subclass takes a name of its own)",
        "planted.py:27 def eventually: testkit.eventually exists",
    ]), found
