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
    standalone: bool = Field(default=False, description="No tenancy")
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
    assert parse(["--standalone"]).standalone is True
    assert parse(["--no-standalone"]).standalone is False


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
