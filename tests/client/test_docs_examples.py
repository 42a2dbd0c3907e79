"""Every ```python block of docs/client.md and docs/quickstart.md runs, as written, against the live stack.

Each block runs in its own interpreter with only `SANDPOOL_URL` (and
`SANDPOOL_TOKEN` when the stack has auth) set, as a reader would run it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from client_stack import Stack
from sandbox_env import sandbox_python
from testkit import scrubbed_env

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(name: str) -> list[tuple[str, int, str]]:
    text = (DOCS / name).read_text()
    return [(name, text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


EXAMPLES = python_blocks("client.md") + python_blocks("quickstart.md")


def test_the_docs_have_examples() -> None:
    assert len(python_blocks("client.md")) >= 8
    assert len(python_blocks("quickstart.md")) >= 1
    for doc, line, code in EXAMPLES:
        compile(code, f"docs/{doc}:{line}", "exec")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("doc", "line", "code"), EXAMPLES, ids=[f"{d}:{n}" for d, n, _ in EXAMPLES])
def test_doc_example_runs(stack: Stack, tmp_path: Path, doc: str, line: int, code: str) -> None:
    if "matplotlib" in code:
        sandbox_python()  # a skip saying how to build it, when sandboxes lack the scientific stack
    env = scrubbed_env(**{k: v for k, v in stack.env.items() if k in ("SANDPOOL_URL", "SANDPOOL_TOKEN")})
    script = tmp_path / f"{doc.replace('.', '_')}_line{line}.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, f"docs/{doc}:{line} failed:\n{proc.stdout}\n{proc.stderr}"
