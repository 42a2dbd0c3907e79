"""The api refuses to start on configuration that would leave it open or ambiguous: one explicit mode (trusted
keys, or --no-auth), asymmetric algorithms only, trusted keys that are public keys."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandpool.api.app import create_app
from sandpool.api.settings import ApiSettings
from sandpool.cli import build_parser
from sandpool.core.settings import ConfigurationError, settings_from_args
from sandpool.edge.settings import EdgeSettings

from .conftest import Keys


def settings(keys: Keys, **overrides: Any) -> ApiSettings:
    values: dict[str, Any] = {"auth_public_keys": [str(keys.public)]}
    values.update(overrides)
    return ApiSettings(**values)


@pytest.mark.parametrize("algorithms", [["HS256"], ["EdDSA", "none"], ["HS512"], ["RS512"], []])
def test_symmetric_none_and_unknown_algorithms_are_refused(keys: Keys, algorithms: list[str]) -> None:
    with pytest.raises(ValueError, match="auth_algorithms"):
        settings(keys, auth_algorithms=algorithms)
    with pytest.raises(ValueError, match="auth_algorithms"):
        EdgeSettings(auth_algorithms=algorithms)


def test_asymmetric_algorithms_are_accepted(keys: Keys) -> None:
    assert settings(keys, auth_algorithms=["EdDSA", "RS256", "ES256"]).auth_algorithms == ["EdDSA", "RS256", "ES256"]
    assert EdgeSettings().auth_algorithms == ["EdDSA"]


def test_no_mode_or_both_modes_refuse_to_start(keys: Keys, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no mode"):
        create_app(ApiSettings())
    with pytest.raises(ConfigurationError, match="exclude each other"):
        create_app(settings(keys, auth=False))
    jwks = tmp_path / "jwks.json"
    jwks.write_text('{"keys": []}')
    with pytest.raises(ConfigurationError, match="exclude each other"):
        create_app(ApiSettings(auth_jwks=str(jwks), auth=False))
    assert settings(keys).has_trusted_keys and not ApiSettings(auth=False).has_trusted_keys
    create_app(ApiSettings(auth=False))  # standalone: builds (nothing connects before its lifespan)
    create_app(settings(keys))


def test_tls_certificate_and_key_go_together(keys: Keys, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="--tls-cert and --tls-key"):
        create_app(settings(keys, tls_cert=tmp_path / "tls.crt"))
    with pytest.raises(ConfigurationError, match="--tls-cert and --tls-key"):
        create_app(settings(keys, tls_key=tmp_path / "tls.key"))


def test_private_key_or_garbage_as_trusted_key_is_refused(keys: Keys, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="private key"):
        create_app(settings(keys, auth_public_keys=[str(keys.private)]))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ConfigurationError, match="garbage.pem"):
        create_app(settings(keys, auth_public_keys=[str(garbage)]))
    with pytest.raises(ConfigurationError, match="cannot read"):
        create_app(settings(keys, auth_public_keys=[str(tmp_path / "missing.pem")]))


def test_the_retired_topology_settings_are_gone() -> None:
    """No internal credential and no upstream URL: the edge hands the session layer its caller in process."""
    for name in ("scheduler_url", "internal_token", "internal_token_file", "standalone", "controller",
                 "reap_interval_seconds", "provider", "data_dir"):
        assert name not in ApiSettings.model_fields, name


def test_the_key_flag_is_repeatable(keys: Keys, other_keys: Keys) -> None:
    args = build_parser("api").parse_args(["api", "--auth-public-key", str(keys.public),
                                           "--auth-public-key", str(other_keys.public)])
    parsed = settings_from_args(ApiSettings, args)
    assert parsed.auth_public_keys == [str(keys.public), str(other_keys.public)] and parsed.auth


def test_command_refuses_without_a_mode_or_with_a_symmetric_algorithm(keys: Keys) -> None:
    env = {"PATH": "/usr/bin:/bin"}

    def api(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sandpool", "api", *args], capture_output=True, text=True,
                              timeout=60, env=env)

    refused = api()
    assert refused.returncode == 2 and "no mode" in refused.stderr and "--no-auth" in refused.stderr
    assert "--auth-public-key" in refused.stderr
    both = api("--no-auth", "--auth-public-key", str(keys.public))
    assert both.returncode == 2 and "exclude each other" in both.stderr
    hs = api("--auth-public-key", str(keys.public), "--auth-algorithms", "EdDSA,HS256")
    assert hs.returncode == 2 and "HS256" in hs.stderr and "--auth-algorithms" in hs.stderr
