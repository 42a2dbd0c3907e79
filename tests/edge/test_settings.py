"""The proxy refuses to start on configuration that would leave it open or ambiguous."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandpool.core.settings import ConfigurationError
from sandpool.edge.app import create_app
from sandpool.edge.settings import ProxySettings

from .conftest import Keys


def settings(keys: Keys, **overrides: Any) -> ProxySettings:
    values: dict[str, Any] = {"auth_public_keys": [str(keys.public)], "internal_token": "x"}
    values.update(overrides)
    return ProxySettings(**values)


@pytest.mark.parametrize("algorithms", [["HS256"], ["EdDSA", "none"], ["HS512"], ["RS512"], []])
def test_symmetric_none_and_unknown_algorithms_are_refused(keys: Keys, algorithms: list[str]) -> None:
    with pytest.raises(ValueError, match="auth_algorithms"):
        settings(keys, auth_algorithms=algorithms)


def test_no_trusted_key_refuses_to_start(keys: Keys) -> None:
    with pytest.raises(ConfigurationError, match="no trusted key"):
        create_app(settings(keys, auth_public_keys=[]))


def test_no_internal_credential_refuses_to_start(keys: Keys, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="SANDPOOL_INTERNAL_TOKEN"):
        create_app(settings(keys, internal_token=None))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigurationError, match="empty"):
        create_app(settings(keys, internal_token=None, internal_token_file=empty))
    good = tmp_path / "token"
    good.write_text("from-a-file\n")
    assert settings(keys, internal_token=None, internal_token_file=good).resolved_internal_token() == "from-a-file"


def test_private_key_or_garbage_as_trusted_key_is_refused(keys: Keys, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="private key"):
        create_app(settings(keys, auth_public_keys=[str(keys.private)]))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ConfigurationError, match="garbage.pem"):
        create_app(settings(keys, auth_public_keys=[str(garbage)]))
    with pytest.raises(ConfigurationError, match="cannot read"):
        create_app(settings(keys, auth_public_keys=[str(tmp_path / "missing.pem")]))


def test_scheduler_url_scheme_is_checked(keys: Keys) -> None:
    with pytest.raises(ValueError, match="scheduler_url"):
        settings(keys, scheduler_url="ftp://x")
    assert settings(keys, scheduler_url="unix:///run/s.sock").scheduler_url == "unix:///run/s.sock"


def test_command_refuses_without_key_and_accepts_repeatable_key_flag(keys: Keys, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "SANDPOOL_INTERNAL_TOKEN": "x"}
    refused = subprocess.run([sys.executable, "-m", "sandpool", "proxy"], capture_output=True, text=True,
                             timeout=60, env=env)
    assert refused.returncode == 2 and "no trusted key" in refused.stderr
    hs = subprocess.run([sys.executable, "-m", "sandpool", "proxy", "--auth-public-key", str(keys.public),
                         "--auth-algorithms", "EdDSA,HS256"], capture_output=True, text=True, timeout=60, env=env)
    assert hs.returncode == 2 and "HS256" in hs.stderr and "--auth-algorithms" in hs.stderr
    no_token = subprocess.run([sys.executable, "-m", "sandpool", "proxy", "--auth-public-key", str(keys.public),
                               "--auth-public-key", str(keys.public)], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin"})
    assert no_token.returncode == 2 and "SANDPOOL_INTERNAL_TOKEN" in no_token.stderr
