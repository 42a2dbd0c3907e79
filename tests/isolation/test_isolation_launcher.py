"""Choosing the launcher from the local provider's settings, and `auto`'s fallback."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sandpool.core.settings import ConfigurationError
from sandpool.providers.local.launcher import SubprocessLauncher
from sandpool.providers.local.zygote import ZygoteError, ZygoteLauncher, make_launcher


def _settings(tmp_path: Path, **fields: object) -> SimpleNamespace:
    return SimpleNamespace(agent_python=None, stop_grace_seconds=1.0,
                           sandboxes_dir=lambda: tmp_path / "data" / "sandboxes", **fields)


def test_choices(tmp_path: Path) -> None:
    assert isinstance(make_launcher(_settings(tmp_path, launcher="subprocess")), SubprocessLauncher)
    zygote = make_launcher(_settings(tmp_path, launcher="zygote", isolation_disable=["seccomp"]))
    assert isinstance(zygote, ZygoteLauncher) and zygote.fallback is None
    assert zygote.client.disabled == frozenset({"seccomp"})
    assert zygote.client.run_dir is None  # a private temporary directory, made at start
    auto = make_launcher(_settings(tmp_path))  # settings without the fields: auto
    if sys.platform.startswith("linux"):
        assert isinstance(auto, ZygoteLauncher) and isinstance(auto.fallback, SubprocessLauncher)


@pytest.mark.parametrize("fields, message", [
    ({"launcher": "docker"}, "--launcher / SANDPOOL_LAUNCHER"),
    ({"isolation_disable": ["seccomp", "everything"]}, "--isolation-disable / SANDPOOL_ISOLATION_DISABLE"),
    ({"isolation_disable": ["rlimits"]}, "unknown layer"),
])
def test_bad_settings_name_the_setting(tmp_path: Path, fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make_launcher(_settings(tmp_path, **fields))


async def test_auto_falls_back_loudly_when_the_zygote_cannot_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    broken = "/bin/false"  # exits at once: no hello ever comes
    launcher = ZygoteLauncher(tmp_path / "z", python=broken, fallback=SubprocessLauncher())
    assert await launcher.start() is None
    assert launcher.using_fallback
    assert launcher.describe()["launcher"] == "subprocess" and launcher.describe()["namespaces"] is False
    assert any("ISOLATION MISSING" in r.getMessage() and "zygote could not start" in r.getMessage()
               for r in caplog.records)
    await launcher.aclose()

    strict = ZygoteLauncher(tmp_path / "z2", python=broken)
    with pytest.raises(ZygoteError, match="did not start"):
        await strict.start()
    await strict.aclose()
