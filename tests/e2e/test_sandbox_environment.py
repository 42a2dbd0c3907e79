"""What a new user gets from `sandpool up`: the scientific stack in every sandbox, figures as files.

With the built `python` environment (`.ci/run` builds it): numpy, pandas, scipy,
sympy and matplotlib import, and a plotted figure comes back as a file through the
api and through the Python client. Without a package index: `up` builds small
environments itself on first use (progress on stderr), finds them the next time,
the CreateSession `image` hint picks one, and a build that cannot work stops `up`
in one line before anything starts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sandbox_env import make_lock, sandbox_python
from testkit import PROC, alive, free_port
from up_harness import assert_stopped_clean, exec_code

from sandpool.client import Client

PNG = b"\x89PNG\r\n\x1a\n"
PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('from the sandbox')\nplt.show()"


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="spv", dir="/tmp"))
    path.chmod(0o755)  # sandboxes without namespaces read environments built under it in place
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_scientific_stack_and_a_figure_through_the_api_and_the_client(up_factory) -> None:
    python = sandbox_python()
    up = up_factory("--sandbox-python", python)
    url, token = up.printed("SANDPOOL_URL="), up.printed("SANDPOOL_TOKEN=")
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        session = http.post("/sessions", json={}).json()["session_id"]
        imported = exec_code(http, session, "import numpy, pandas, scipy, sympy, matplotlib\n"
                                             "print(numpy.linspace(0, 1, 3).sum(), sympy.sqrt(8))")
        assert (imported["stdout"], imported["return_code"]) == ("1.5 2*sqrt(2)\n", 0), imported["stderr"]
        drawn = exec_code(http, session, PLOT)
        assert [f["file_id"] for f in drawn["content"]] == ["figure-1.png"], drawn
        got = http.get(f"/sessions/{session}/files", params={"path": "figure-1.png"})
        assert got.status_code == 200 and got.content.startswith(PNG)
        assert http.delete(f"/sessions/{session}").status_code == 204

    with Client(url, token) as client, client.session() as s:
        result = s.run_python("import pandas as pd\ndf = pd.DataFrame({'x': [1, 2, 3], 'y': [3, 1, 2]})\n"
                              "df.plot(x='x', y='y')\nimport matplotlib.pyplot as plt\nplt.show()")
        assert result.ok, result.stderr
        files = s.produced_files(result)
        assert list(files) == ["figure-1.png"] and files["figure-1.png"].startswith(PNG)
        shell = s.run_bash("pip install requests")
        assert shell.return_code == 1 and "no network access" in shell.stderr
    assert_stopped_clean(up)


def test_up_builds_environments_on_first_use_and_the_image_hint_picks_one(up_factory, tmp: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDPOOL_SANDBOX_PYTHON")
    python_lock = make_lock(tmp / "python", name="probe_default", source="WHO = 'python'\n")
    other_lock = make_lock(tmp / "other", name="probe_other", source="WHO = 'other'\n")
    pools = tmp / "pools.yaml"
    pools.write_text(f"environments:\n  - {{name: other, requirements: {other_lock}}}\n"
                     "pools:\n  - {name: default, image: python, warm: 2, ceiling: 4}\n"
                     "  - {name: other, image: other, warm: 1, ceiling: 2}\n")
    args = ("--no-auth", "--pools-file", str(pools), "--sandbox-requirements", str(python_lock),
            "--environments-dir", str(tmp / "cache"), "--capacity-wait-seconds", "30")
    up = up_factory(*args)
    url = up.printed("SANDPOOL_URL=", timeout=120)
    log = up.log_tail()
    for name in ("python", "other"):
        assert f"sandpool up: environment {name}: building from " in log
        assert f"sandpool up: environment {name}: built in " in log
    with httpx.Client(base_url=url, timeout=60) as http:
        for image, module in ((None, "probe_default"), ("python", "probe_default"), ("other", "probe_other"),
                              ("no-such-environment", "probe_default")):
            created = http.post("/sessions", json={"image": image} if image else {})
            assert created.status_code == 201, created.text
            session = created.json()["session_id"]
            ran = exec_code(http, session, f"import {module}, sys\nprint({module}.WHO, sys.prefix)")
            who, prefix = ran["stdout"].split()
            assert (who, ran["return_code"]) == (module.removeprefix("probe_").replace("default", "python"), 0)
            assert prefix.startswith(str(tmp / "cache") + "/py")
            http.delete(f"/sessions/{session}")
    assert_stopped_clean(up)

    again = up_factory(*args)
    again.printed("SANDPOOL_URL=", timeout=120)
    assert "building from" not in again.log_tail()  # built once per lock, found after
    assert_stopped_clean(again)


def test_an_environment_that_cannot_be_built_stops_up_in_one_line(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDPOOL_SANDBOX_PYTHON")
    lock = make_lock(tmp, bad_hash=True)
    data_dir = tmp / "data"
    argv = ["up", "--port", str(free_port()), "--data-dir", str(data_dir), "--pool-size", "1", "--max-sandboxes", "2",
            "--sandbox-requirements", str(lock), "--environments-dir", str(tmp / "cache")]
    result = subprocess.run([sys.executable, "-m", "sandpool", *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    *progress, last = result.stderr.splitlines()
    assert all(line.startswith("sandpool up: environment python: ") for line in progress), progress
    assert last.startswith("sandpool up: the sandbox environment could not be built: python from ")
    assert "DO NOT MATCH THE HASHES" in last and "pip's full output: " in last
    assert [p.name for p in (tmp / "cache").iterdir() if not p.name.startswith(".")] == []
    leftovers = [p.name for p in PROC.iterdir() if p.name.isdigit() and alive(int(p.name))
                 and str(data_dir) in (p / "cmdline").read_bytes().decode(errors="replace")]
    assert leftovers == []
    assert not (data_dir / "sandboxes").exists()


def test_a_preimport_the_environment_lacks_stops_up_in_one_line(tmp: Path) -> None:
    lock = make_lock(tmp)
    pools = tmp / "pools.yaml"
    pools.write_text(f"environments:\n  - {{name: tiny, requirements: {lock}, preimport: [no_such_module]}}\n"
                     "pools:\n  - {name: default, image: tiny}\n")
    argv = ["up", "--port", str(free_port()), "--data-dir", str(tmp / "data"), "--pools-file", str(pools),
            "--environments-dir", str(tmp / "cache")]
    result = subprocess.run([sys.executable, "-m", "sandpool", *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == ("sandpool up: the sandbox environment could not be built: tiny: its "
                                              "preimport names modules it does not have: no_such_module")


def test_a_sandbox_python_that_does_not_run_stops_up_in_one_line(tmp: Path) -> None:
    argv = ["up", "--port", str(free_port()), "--data-dir", str(tmp / "data"), "--sandbox-python", str(tmp / "nope")]
    result = subprocess.run([sys.executable, "-m", "sandpool", *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"sandpool up: the controller could not start: --sandbox-python "
                                          f"{tmp / 'nope'} does not run: No such file or directory"]
