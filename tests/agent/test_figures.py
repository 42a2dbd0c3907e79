"""Figures are files: matplotlib drawings come back as PNGs in the workspace, listed as produced files.

Runs a real agent on the built `python` environment (numpy, pandas, scipy, sympy,
matplotlib: the sandbox image's lock); skips with a one-line reason when it is not
built. Answers are parsed with the Anthropic SDK's own result-block types, as a
client of contract v1 would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import Agent, S, content, start_agent
from anthropic.types.beta import BetaCodeExecutionResultBlock, BetaCodeExecutionToolResultBlock
from sandbox_env import sandbox_python

from sandpool.providers.local import environments

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """An agent per test: figure numbers start at 1 in each."""
    python = sandbox_python()
    built = environments.from_interpreter(python)
    args = ["--python-executable", python]
    if built.matplotlib_cache:
        args += ["--matplotlib-cache", built.matplotlib_cache]
    a = start_agent(tmp_path_factory.mktemp("figures"), *args)
    yield a
    a.stop()


def produced(agent: Agent, code: str) -> tuple[BetaCodeExecutionResultBlock, list[str]]:
    """Run `code`; the result parsed by the Anthropic SDK, and the produced files' ids."""
    block = BetaCodeExecutionToolResultBlock.model_validate(agent.py(code)["result_block"])
    assert isinstance(block.content, BetaCodeExecutionResultBlock)
    return block.content, [f.file_id for f in block.content.content]


def fetch(agent: Agent, file_id: str) -> bytes:
    got = agent.client.get(f"{S}/files", params={"path": file_id})
    assert got.status_code == 200, got.text
    return got.content


def test_the_scientific_stack_imports(agent: Agent) -> None:
    result = content(agent.py("import numpy, pandas, scipy, sympy, matplotlib\n"
                              "print(numpy.__version__, pandas.__version__, matplotlib.get_backend())"))
    assert result["return_code"] == 0, result["stderr"]
    assert result["stderr"] == ""  # no font cache rebuilt, no warning about a config directory
    assert result["stdout"].split()[2].lower() == "agg"


def test_plt_show_returns_the_figure_as_a_png_file(agent: Agent) -> None:
    result, files = produced(agent, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\n"
                                    "plt.title('chart')\nplt.show()\nprint('shown')")
    assert (result.return_code, result.stdout) == (0, "shown\n"), result.stderr
    assert files == ["figure-1.png"]
    data = fetch(agent, "figure-1.png")
    assert data.startswith(PNG) and len(data) > 1000
    # Shown means closed, as in a notebook: the next call starts with no figure.
    assert content(agent.py("print(plt.get_fignums())"))["stdout"] == "[]\n"


def test_figures_left_open_at_the_end_of_a_call_are_files_too(agent: Agent) -> None:
    _, files = produced(agent, "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.bar([1, 2], [3, 4])\n"
                               "plt.figure()\nplt.plot([1, 0])")
    assert sorted(files) == ["figure-1.png", "figure-2.png"]
    assert all(fetch(agent, f).startswith(PNG) for f in files)


def test_each_show_in_a_call_writes_its_own_file(agent: Agent) -> None:
    _, files = produced(agent, "import matplotlib.pyplot as plt\nfor n in range(2):\n    plt.plot([n, 1])\n"
                               "    plt.show()\n    plt.close('all')")
    assert sorted(files) == ["figure-1.png", "figure-2.png"]


def test_a_call_without_figures_creates_nothing(agent: Agent) -> None:
    before = sorted(p.name for p in agent.workspace.iterdir())
    result, files = produced(agent, "import matplotlib.pyplot as plt\nimport numpy as np\nprint(np.arange(3).sum())")
    assert (result.stdout, files) == ("3\n", [])
    assert sorted(p.name for p in agent.workspace.iterdir()) == before


def test_a_file_of_the_users_is_never_overwritten(agent: Agent) -> None:
    agent.client.post(f"{S}/files", files={"file": ("figure-1.png", b"mine")})
    _, files = produced(agent, "import matplotlib.pyplot as plt\nplt.plot([1])\nplt.show()")
    assert files == ["figure-2.png"]
    assert fetch(agent, "figure-1.png") == b"mine"


def test_figures_go_to_the_workspace_wherever_the_code_went(agent: Agent) -> None:
    _, files = produced(agent, "import os, matplotlib.pyplot as plt\nos.makedirs('sub', exist_ok=True)\n"
                               "os.chdir('sub')\nplt.plot([1])\nplt.show()\nos.chdir('..')")
    assert files == ["figure-1.png"]


def test_a_figure_that_cannot_be_drawn_is_reported_and_the_session_goes_on(agent: Agent) -> None:
    result, files = produced(agent, "import matplotlib.pyplot as plt\nplt.text(0.5, 0.5, r'$\\frac{$')")
    assert files == []
    assert "figure 1 could not be saved: ValueError" in result.stderr
    assert content(agent.py("print(len(plt.get_fignums()))"))["stdout"] == "0\n"
    _, files = produced(agent, "plt.plot([1])\nplt.show()")
    assert files == ["figure-1.png"]  # the number of the one that failed is not lost


def test_a_failing_call_still_returns_what_it_drew(agent: Agent) -> None:
    result, files = produced(agent, "import matplotlib.pyplot as plt\nplt.plot([2, 1])\nraise ValueError('late')")
    assert result.return_code == 1 and "ValueError: late" in result.stderr
    assert files == ["figure-1.png"]


def test_figures_need_no_display_server(agent: Agent) -> None:
    result = content(agent.py("import os\nprint(os.environ.get('DISPLAY'), os.environ.get('MPLBACKEND'))"))
    assert result["stdout"] == "None Agg\n"
    assert not (Path(agent.workspace) / ".config").exists()  # matplotlib's cache is private, not the workspace's
