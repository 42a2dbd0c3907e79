"""`sandpool controller`: keeps the pools warm, reaps sessions, reconciles; serves probes and /metrics."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from sandpool.controller.settings import ControllerSettings
from sandpool.core.settings import ServiceSettings, add_settings_arguments, dump_settings, settings_from_args
from sandpool.providers import registry

log = logging.getLogger(__name__)


def provider_settings_classes() -> dict[str, type[ServiceSettings]]:
    """Each registered provider's own settings class (its flags join the controller's)."""
    return {name: kind.settings_class() for name, kind in registry.PROVIDERS.items()}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "controller", help="keep the pools warm, reap sessions, reconcile with the provider",
        description="The pool controller: starts sandboxes ahead of demand and for waiting CreateSession "
                    "calls, destroys released, expired and orphaned ones, reaps idle and over-lifetime "
                    "sessions. One leader is active across replicas. Secrets come from the environment.",
    )
    seen = set(ControllerSettings.model_fields)
    add_settings_arguments(parser, ControllerSettings)
    for cls in provider_settings_classes().values():
        # A field two classes share (e.g. data_dir) is one flag feeding both.
        add_settings_arguments(parser, cls, exclude=seen & set(cls.model_fields))
        seen |= set(cls.model_fields)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sandpool.controller.app import create_app
    from sandpool.core.logs import configure_logging
    from sandpool.core.serve import serve

    settings: ControllerSettings = settings_from_args(ControllerSettings, args)
    configure_logging("controller", settings.log_level)

    def build() -> Any:
        kind = registry.kind(settings.provider)
        provider = kind.build(settings_from_args(kind.settings_class(), args))
        app = create_app(settings, provider=provider)
        log.info("starting controller", extra={"settings": dump_settings(settings)})
        return app

    return serve("controller", build, host=settings.host, port=settings.port, unix_socket=settings.unix_socket,
                 failure_file=settings.start_failure_file, http="httptools", timeout_graceful_shutdown=10)
