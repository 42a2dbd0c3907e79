"""Every setting is a flag and a SANDPOOL_ variable; secrets are never flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import Field

from sandpool.core.settings import (
    CommaList,
    ConfigurationError,
    ServiceSettings,
    add_settings_arguments,
    read_secret,
    secret_field,
    settings_from_args,
)


class DemoSettings(ServiceSettings):
    pool_size: int = Field(default=2, ge=0, description="Warm sandboxes")
    images: CommaList = Field(default_factory=lambda: ["python"], description="Images")
    verbose: bool = Field(default=False, description="Say more")
    token: str | None = secret_field("A secret")


def parse(argv: list[str]) -> DemoSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, DemoSettings)
    return settings_from_args(DemoSettings, parser.parse_args(argv))


def test_defaults_env_and_flags_in_that_order(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse([]).pool_size == 2
    monkeypatch.setenv("SANDPOOL_POOL_SIZE", "5")
    assert parse([]).pool_size == 5
    assert parse(["--pool-size", "7"]).pool_size == 7


def test_lists_are_comma_separated_in_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDPOOL_IMAGES", "a, b,c")
    assert parse([]).images == ["a", "b", "c"]
    assert parse(["--images", "x,y", "--images", "z"]).images == ["x", "y", "z"]


def test_booleans_take_flag_and_negation() -> None:
    assert parse(["--verbose"]).verbose is True
    assert parse(["--no-verbose"]).verbose is False


def test_secret_is_not_a_flag_but_is_read_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        parse(["--token", "x"])
    monkeypatch.setenv("SANDPOOL_TOKEN", "s3cret")
    assert parse([]).token == "s3cret"


def test_bad_value_names_the_flag_and_variable() -> None:
    with pytest.raises(ConfigurationError) as info:
        parse(["--pool-size", "-1"])
    assert "--pool-size" in str(info.value) and "SANDPOOL_POOL_SIZE" in str(info.value)


def test_read_secret_prefers_file_and_refuses_empty(tmp_path: Path) -> None:
    f = tmp_path / "s"
    f.write_text("fromfile\n")
    assert read_secret("fromenv", f, what="x") == "fromfile"
    assert read_secret("fromenv", None, what="x") == "fromenv"
    f.write_text("  \n")
    with pytest.raises(ConfigurationError):
        read_secret(None, f, what="x")
    with pytest.raises(ConfigurationError):
        read_secret(None, tmp_path / "missing", what="x")


# --- the two processes' settings: each setting where it acts --------------------------------------

RETIRED = ("standalone", "controller", "internal_token", "internal_token_file", "scheduler_url",
           "forward_max_connections")
"""Settings of the proxy -> scheduler hop, which is gone: neither process has them."""


def test_each_setting_lives_in_the_process_that_acts_on_it() -> None:
    from sandpool.api.settings import ApiSettings
    from sandpool.controller.pools import PoolSettings
    from sandpool.controller.settings import ControllerSettings
    from sandpool.edge.settings import EdgeSettings
    from sandpool.sessions.settings import SessionSettings
    from sandpool.state.settings import RedisSettings

    api, controller = set(ApiSettings.model_fields), set(ControllerSettings.model_fields)
    # The api is the edge over the session layer; both read the pools (the api leases from them).
    assert set(EdgeSettings.model_fields) | set(SessionSettings.model_fields) <= api
    assert set(PoolSettings.model_fields) | set(RedisSettings.model_fields) <= api & controller
    # The provider, its data and the session reaper run in the controller only.
    for name in ("provider", "data_dir", "reap_interval_seconds", "reap_batch"):
        assert name in controller and name not in api, name
    # Authentication and the session layer's limits are the api's only.
    for name in ("auth", "auth_public_keys", "auth_jwks", "capacity_wait_seconds", "default_idle_timeout_seconds",
                 "forward_connect_timeout_seconds", "max_body_bytes"):
        assert name in api and name not in controller, name
    assert [n for n in RETIRED if n in api | controller] == []


def test_the_api_starts_only_in_one_clear_mode(tmp_path: Path) -> None:
    from sandpool.api.settings import ApiSettings

    key = tmp_path / "key.pem"  # (its content is the key ring's business, read at start)
    ApiSettings(auth=False).check_startable()
    ApiSettings(auth_public_keys=[str(key)]).check_startable()
    ApiSettings(auth_jwks="https://keys.example/jwks.json").check_startable()
    with pytest.raises(ConfigurationError, match="no mode"):
        ApiSettings().check_startable()
    with pytest.raises(ConfigurationError, match="exclude each other"):
        ApiSettings(auth=False, auth_public_keys=[str(key)]).check_startable()
    with pytest.raises(ConfigurationError, match="--tls-cert and --tls-key"):
        ApiSettings(auth=False, tls_cert=tmp_path / "cert.pem").check_startable()


def test_the_commands_take_their_own_settings_as_flags() -> None:
    from sandpool.api.settings import ApiSettings
    from sandpool.cli import build_parser
    from sandpool.controller.settings import ControllerSettings

    args = build_parser("api").parse_args(["api", "--no-auth", "--capacity-wait-seconds", "3"])
    api = settings_from_args(ApiSettings, args)
    assert api.auth is False and api.capacity_wait_seconds == 3
    args = build_parser("controller").parse_args(["controller", "--reap-interval-seconds", "0.5",
                                                  "--data-dir", "/tmp/x"])
    controller = settings_from_args(ControllerSettings, args)
    assert controller.reap_interval_seconds == 0.5 and controller.data_dir == Path("/tmp/x")
    for command, flag in (("api", "--reap-interval-seconds"), ("controller", "--no-auth"),
                          ("api", "--internal-token-file"), ("controller", "--scheduler-url")):
        with pytest.raises(SystemExit):
            build_parser(command).parse_args([command, flag, "1"])
