"""One typed settings object per service, and the command line derived from it.

Every field of a service's settings is a flag (`--pool-size`) and an
environment variable (`SANDPOOL_POOL_SIZE`); the flag wins. Lists are
comma-separated in both. Fields marked `secret_field()` are read from the
environment (or a file named by a companion `*_file` flag) only: a secret given
as a flag value would show in every process listing.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Set
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from pydantic import BeforeValidator, Field, ValidationError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sandpool.core.redact import redact

ENV_PREFIX = "SANDPOOL_"


def _split_commas(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split_commas)]
"""A list setting: `a,b,c` on the command line and in the environment."""


def secret_field(description: str) -> Any:
    """A secret: environment only, never a flag."""
    return Field(default=None, description=description, json_schema_extra={"cli": False})


class ServiceSettings(BaseSettings):
    """Base of every service's settings: `SANDPOOL_*` environment, fail loudly on bad values."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)


class ServingSettings(ServiceSettings):
    """Where an HTTP service of sandpool listens and how a supervisor learns why it did not start."""

    host: str = Field(default="127.0.0.1", description="Address to listen on")
    port: int = Field(default=8080, ge=0, le=65535, description="Port to listen on")
    unix_socket: Path | None = Field(default=None, description=(
        "Listen on this Unix socket (mode 0600) instead of --host/--port"))
    log_level: str = Field(default="info", description="Log level (debug, info, warning, error)")
    start_failure_file: Path | None = Field(default=None, description=(
        "Where a failed start writes its one-line reason (a supervisor's termination message; "
        "sandpool up reads it)"))


class ConfigurationError(Exception):
    """Bad configuration: stops the start with a message naming the setting."""


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _is_cli(info: Any) -> bool:
    extra = info.json_schema_extra
    return not (isinstance(extra, dict) and extra.get("cli") is False)


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    return get_origin(annotation) is not None and bool in get_args(annotation) and len(get_args(annotation)) <= 2


def _is_list(annotation: Any) -> bool:
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return get_origin(annotation) is list


def add_settings_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                           settings_cls: type[ServiceSettings], *, exclude: Set[str] = frozenset()) -> None:
    """Add one flag per settings field, with its help text, default and variable name (a setting
    that is never a flag, a secret, is named in the help's epilog, or a group's description)."""
    for name, info in settings_cls.model_fields.items():
        if name in exclude:
            continue
        if not _is_cli(info):
            note = f" {env_name(name)}: {info.description}"
            if isinstance(parser, argparse.ArgumentParser):
                parser.epilog = (parser.epilog or "") + note
            else:  # argparse prints a group's description, never an epilog set on it
                parser.description = (parser.description or "") + note
            continue
        default = info.get_default(call_default_factory=True)
        if isinstance(default, list):
            default = ",".join(map(str, default)) or "(none)"
        shown = "(none)" if default is None else default
        help_text = f"{info.description or ''} [default: {shown}; env {env_name(name)}]"
        if _is_bool(info.annotation):
            parser.add_argument(flag_name(name), dest=name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        elif _is_list(info.annotation) and name.endswith("s"):
            # Repeatable and comma-separated both work: --auth-public-key a --auth-public-key b.
            parser.add_argument(flag_name(name), dest=name, default=None, action="append", help=help_text)
        else:
            parser.add_argument(flag_name(name), dest=name, default=None, help=help_text)


def settings_from_args(settings_cls: type[ServiceSettings], args: argparse.Namespace,
                       **overrides: Any) -> Any:
    """Build the settings: flags override the environment, which overrides defaults."""
    given: dict[str, Any] = {}
    for name in settings_cls.model_fields:
        value = getattr(args, name, None)
        if value is None:
            continue
        if isinstance(value, list):
            value = [item for chunk in value for item in _split_commas(chunk)]
        given[name] = value
    given.update(overrides)
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        raise ConfigurationError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming each bad setting by its flag and variable (a check across settings by its text)."""
    problems = []
    for err in exc.errors():
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["loc"]:
            field = str(err["loc"][0])
            problems.append(f"{flag_name(field)} / {env_name(field)}: {message}")
        else:
            problems.append(message)
    return "invalid configuration: " + "; ".join(problems)


def read_secret(value: str | None, file: Path | None, *, what: str) -> str | None:
    """A secret from its environment value or its file; a file wins when both are set."""
    if file is not None:
        try:
            text = Path(file).read_text().strip()
        except OSError as exc:
            raise ConfigurationError(f"cannot read {what} from {file}: {exc.strerror}") from None
        if not text:
            raise ConfigurationError(f"{what} file {file} is empty")
        return text
    return value or None


def dump_settings(settings: BaseSettings) -> str:
    """Settings as JSON with secrets blanked (and credentials in URLs), for the start-up log line."""
    out = {}
    for name, info in type(settings).model_fields.items():
        value = getattr(settings, name)
        out[name] = "***" if (not _is_cli(info) and value) else redact(value)
    return json.dumps(out, default=str, sort_keys=True)


def environ() -> dict[str, str]:
    """The only sanctioned read of the process environment outside pydantic-settings."""
    return dict(os.environ)
