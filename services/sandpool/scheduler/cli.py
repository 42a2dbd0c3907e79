"""`sandpool scheduler [--standalone] ...`: the scheduler (and its pool controller) under uvicorn."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from sandpool.core.settings import (
    ServiceSettings,
    add_settings_arguments,
    dump_settings,
    settings_from_args,
)
from sandpool.providers import registry
from sandpool.scheduler.settings import SchedulerSettings

log = logging.getLogger(__name__)


def provider_settings_classes() -> dict[str, type[ServiceSettings]]:
    """Each registered provider's own settings class (its flags join the scheduler's)."""
    return {name: kind.settings_class() for name, kind in registry.PROVIDERS.items()}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "scheduler", help="serve contract v1 from a Redis-backed sandbox pool",
        description="The scheduler: leases pre-warmed sandboxes, forwards calls to their agents, reaps "
                    "expired sessions, and runs the pool controller. Secrets come from the environment.",
    )
    seen = set(SchedulerSettings.model_fields)
    add_settings_arguments(parser, SchedulerSettings)
    for cls in provider_settings_classes().values():
        # A field two classes share (e.g. data_dir) is one flag feeding both.
        add_settings_arguments(parser, cls, exclude=seen & set(cls.model_fields))
        seen |= set(cls.model_fields)
    parser.set_defaults(func=run)


def build_settings(args: argparse.Namespace) -> SchedulerSettings:
    return settings_from_args(SchedulerSettings, args)


def run(args: argparse.Namespace) -> int:
    from sandpool.core.logs import configure_logging
    from sandpool.core.serve import serve
    from sandpool.scheduler.app import create_app

    settings = build_settings(args)
    configure_logging("scheduler", settings.log_level)

    def build() -> Any:
        provider = build_provider(settings, args) if settings.controller else None
        app = create_app(settings, provider=provider)
        log.info("starting scheduler", extra={"settings": dump_settings(settings)})
        return app

    return serve("scheduler", build, host=settings.host, port=settings.port, unix_socket=settings.unix_socket,
                 failure_file=settings.start_failure_file, http="httptools", timeout_graceful_shutdown=10)


def build_provider(settings: SchedulerSettings, args: argparse.Namespace) -> Any:
    """The configured provider, its own settings read from the same flags and environment."""
    kind = registry.kind(settings.provider)
    return kind.build(settings_from_args(kind.settings_class(), args))
