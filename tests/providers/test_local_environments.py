"""Local sandboxes run on the environment their pool's `image` names, shared read-only, never the host's Python.

The environment here is a tiny one built offline (one wheel made by the test); the
scientific `python` environment is exercised in tests/agent and tests/e2e when
`.ci/run` has built it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from local_helpers import output, run
from sandbox_env import make_lock

from sandpool.controller.provider import PoolSpec, ProviderError
from sandpool.providers.local import environments
from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings

ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def cache() -> Iterator[Path]:
    """A cache every uid can traverse (sandboxes without namespaces read it in place) holding `tiny`."""
    root = Path(tempfile.mkdtemp(prefix="spe", dir="/tmp"))
    root.chmod(0o755)
    lock = make_lock(root / "locks")
    environments.build(environments.EnvironmentSpec("tiny", lock), root / "cache",
                       environments.base_python(ROOT))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def pools_file(cache: Path, *, lock: Path | None = None, preimport: str = "[]") -> Path:
    path = cache / "pools.yaml"
    path.write_text("environments:\n"
                    f"  - {{name: tiny, requirements: {lock or cache / 'locks' / 'sandpool_probe_pkg.txt'}, "
                    f"preimport: {preimport}}}\n"
                    "pools:\n  - {name: default, image: python}\n  - {name: tiny, image: tiny}\n")
    return path


@pytest.fixture
async def provider(data_dir: Path, cache: Path) -> AsyncIterator[LocalProvider]:
    p = LocalProvider(LocalProviderSettings(data_dir=data_dir, pools_file=pools_file(cache),
                                            environments_dir=cache / "cache"))
    await p.start()
    yield p
    await p.destroy_all()
    await p.close()


async def test_a_pool_runs_the_environment_its_image_names(provider: LocalProvider) -> None:
    tiny = provider.environments["tiny"]
    assert provider.describe()["environments"]["tiny"] == tiny.python
    info = await provider.create(PoolSpec(name="tiny", image="tiny"), "sb-tiny")
    code = "import sandpool_probe_pkg, sys\nprint(sandpool_probe_pkg.VALUE, sys.prefix)"
    stdout, stderr, rc = output(await run(info.address, info.secret, "code_execution", code=code))
    assert (stdout.split(), rc) == (["42", tiny.path], 0), stderr
    _, stderr, rc = output(await run(info.address, info.secret, "code_execution", code="import numpy"))
    assert rc == 1 and "No module named 'numpy'" in stderr  # this environment's packages, not the host's
    stdout, _, _ = output(await run(info.address, info.secret, "bash_code_execution",
                                    command="command -v python pip"))
    assert stdout.split() == [f"{tiny.path}/bin/python", f"{tiny.path}/bin/pip"]

    other = await provider.create(PoolSpec(name="default", image="python"), "sb-default")
    _, stderr, rc = output(await run(other.address, other.secret, "code_execution", code="import sandpool_probe_pkg"))
    assert rc == 1 and "No module named 'sandpool_probe_pkg'" in stderr


async def test_pip_install_in_a_sandbox_fails_at_once_saying_there_is_no_network(provider: LocalProvider) -> None:
    info = await provider.create(PoolSpec(name="tiny", image="tiny"), "sb-pip")
    _, stderr, rc = output(await run(info.address, info.secret, "bash_code_execution",
                                     command="pip install requests"))
    assert rc == 1 and "this sandbox has no network access" in stderr
    code = "import subprocess, sys\nsys.exit(subprocess.run([sys.executable, '-m', 'pip', 'install', 'x']).returncode)"
    _, stderr, rc = output(await run(info.address, info.secret, "code_execution", code=code))
    assert rc == 1 and "this sandbox has no network access" in stderr


@pytest.mark.skipif(not ROOT, reason="a sandbox of its own uid and root needs root")
async def test_sandboxed_code_cannot_change_the_shared_environment(provider: LocalProvider, cache: Path) -> None:
    tiny = provider.environments["tiny"]
    info = await provider.create(PoolSpec(name="tiny", image="tiny"), "sb-ro")
    code = (f"import os\nfor p in ({tiny.path!r} + '/x', {tiny.path!r} + '/lib/x', {tiny.python!r}):\n"
            "    try:\n        open(p, 'a').close(); print('wrote', p)\n"
            "    except OSError as e:\n        print('refused', e.errno)\n")
    stdout, _, _ = output(await run(info.address, info.secret, "code_execution", code=code))
    assert stdout.split().count("refused") == 3, stdout
    if provider.describe().get("caps_workspace"):  # its own root: only the environment is bound, not the cache
        code = f"import os\nprint(os.path.exists({str(cache / 'cache')!r} + '/' + {Path(tiny.path).name!r} + " \
               f"'/bin/python'), os.listdir({str(cache / 'cache')!r}))"
        stdout, _, _ = output(await run(info.address, info.secret, "code_execution", code=code))
        assert stdout.strip() == f"True ['{Path(tiny.path).name}']"  # no lock files, logs or other builds


async def test_an_environments_preimport_is_imported_before_the_first_call(data_dir: Path, cache: Path) -> None:
    p = LocalProvider(LocalProviderSettings(data_dir=data_dir, environments_dir=cache / "cache",
                                            pools_file=pools_file(cache, preimport="[sandpool_probe_pkg]")))
    await p.start()
    try:
        code = "import sys\nprint('sandpool_probe_pkg' in sys.modules)"
        info = await p.create(PoolSpec(name="tiny", image="tiny"), "sb-pre")
        assert output(await run(info.address, info.secret, "code_execution", code=code))[0] == "True\n"
        other = await p.create(PoolSpec(name="default", image="python"), "sb-plain")
        assert output(await run(other.address, other.secret, "code_execution", code=code))[0] == "False\n"
    finally:
        await p.destroy_all()
        await p.close()


async def test_a_declared_environment_that_is_not_built_stops_the_start(data_dir: Path, cache: Path) -> None:
    lock = make_lock(cache / "other", source="VALUE = 7\n")
    p = LocalProvider(LocalProviderSettings(data_dir=data_dir, pools_file=pools_file(cache, lock=lock),
                                            environments_dir=cache / "cache"))
    with pytest.raises(ProviderError) as err:
        await p.start()
    assert not err.value.transient
    assert str(err.value).startswith("sandbox environment tiny is not built in ")
    assert "python -m sandpool.providers.local.environments --pools-file" in str(err.value)
    await p.close()


async def test_a_given_interpreter_that_is_a_built_environment_brings_its_font_cache(data_dir: Path,
                                                                                      cache: Path) -> None:
    tiny = environments.find(environments.EnvironmentSpec("tiny", cache / "locks" / "sandpool_probe_pkg.txt"),
                             cache / "cache", environments.base_python(ROOT))
    assert tiny is not None
    p = LocalProvider(LocalProviderSettings(data_dir=data_dir, sandbox_python=tiny.python))
    await p.start()
    try:
        python = p.environment_for(PoolSpec(name="default", image="anything"))
        assert python is not None and python.python == tiny.python
        assert python.matplotlib_cache == f"{tiny.path}/{environments.MATPLOTLIB_CACHE}"
        assert p._limits("sb", PoolSpec(name="default", image="python")).sandbox_python == tiny.python
    finally:
        await p.close()


async def test_an_environment_holding_the_data_dir_is_refused(cache: Path) -> None:
    tiny = environments.find(environments.EnvironmentSpec("tiny", cache / "locks" / "sandpool_probe_pkg.txt"),
                             cache / "cache", environments.base_python(ROOT))
    assert tiny is not None and tiny.path is not None
    p = LocalProvider(LocalProviderSettings(data_dir=Path(tiny.path) / "data", sandbox_python=tiny.python))
    with pytest.raises(ProviderError, match="holds the data dir"):
        await p.start()
    await p.close()
    assert not (Path(tiny.path) / "data").exists()  # refused before anything was made
