"""Output floods (bounded memory, visible marker) and produced-file references."""

from __future__ import annotations

import pytest
from agent_harness import Agent, S, content, start_agent
from testkit import rss_kib


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Agent:
    a = start_agent(tmp_path_factory.mktemp("small"), "--max-output-bytes", "4096", "--max-produced-files", "3")
    yield a
    a.stop()


def test_python_flood_is_capped_and_memory_stays_bounded(small: Agent) -> None:
    small.py("print('warm')")
    before = rss_kib(small.proc.pid)
    resp = small.exec("code_execution", code="import os\nchunk = b'x' * (1 << 20)\n"
                                             "for _ in range(200): os.write(1, chunk)\n"
                                             "import sys\nsys.stderr.write('e' * 10000)")
    assert resp.headers["X-Sandpool-Outcome"] == "limit"
    body = resp.json()
    c = content(body)
    assert c["return_code"] == 0
    assert c["stdout"].startswith("x" * 4096)
    assert f"{200 * (1 << 20) - 4096} more bytes discarded" in c["stdout"]
    assert "5904 more bytes discarded" in c["stderr"]
    assert body["limit_exceeded"] == "output"
    # 200 MiB went through; the agent kept 4 KiB of it.
    assert rss_kib(small.proc.pid) - before < 32 * 1024
    assert content(small.py("print('after')"))["stdout"] == "after\n"


def test_bash_flood_with_timeout_is_capped(small: Agent) -> None:
    result = small.sh("yes flood", timeout=1)
    c = content(result)
    assert c["return_code"] == 124
    assert c["stdout"].startswith("flood\nflood\n")
    assert "more bytes discarded" in c["stdout"]
    assert result["limit_exceeded"] == "timeout"
    assert content(small.sh("echo calm"))["stdout"] == "calm\n"


def test_produced_files_are_listed_capped_and_skip_hidden(small: Agent) -> None:
    first = content(small.sh("mkdir -p .hidden p && echo 1 > .hidden/secret && echo 2 > p/one.txt"))
    assert first["content"] == [{"type": "code_execution_output", "file_id": "p/one.txt", "filename": "one.txt"}]
    assert content(small.sh("cat p/one.txt"))["content"] == []  # reading changes nothing
    changed = content(small.sh("echo 3 >> p/one.txt"))["content"]
    assert [f["file_id"] for f in changed] == ["p/one.txt"]
    many = content(small.py("for i in range(10): open(f'p/many{i}.txt', 'w').write('x')"))["content"]
    assert len(many) == 3
    assert all(f["file_id"].startswith("p/many") for f in many)
    for ref in many:
        assert small.client.get(f"{S}/files", params={"path": ref["file_id"]}).content == b"x"
