"""`sandpool proxy`: the authenticated, multi-tenant edge (see docs/proxy.md)."""

from __future__ import annotations

import argparse
from typing import Any

from sandpool.core.logs import configure_logging
from sandpool.core.settings import add_settings_arguments, dump_settings, settings_from_args
from sandpool.proxy.settings import ProxySettings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("proxy", description=__doc__,
                                   help="authenticate tokens, apply workspace policy, forward to the scheduler")
    add_settings_arguments(parser, ProxySettings)
    # The singular spelling the docs use: --auth-public-key A --auth-public-key B.
    parser.add_argument("--auth-public-key", dest="auth_public_keys", action="append", default=None,
                        help="Same as --auth-public-keys (repeatable)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings: ProxySettings = settings_from_args(ProxySettings, args)
    return serve(settings)


def serve(settings: ProxySettings) -> int:
    """Run the proxy in this process until interrupted; the exit status (2: it could not start)."""
    import logging

    from sandpool.core import serve as server
    from sandpool.proxy.app import create_app

    configure_logging("proxy", settings.log_level)

    def build() -> Any:
        app = create_app(settings)  # refuses to build without a trusted key or the internal credential
        logging.getLogger(__name__).info("configuration", extra={"settings": dump_settings(settings)})
        return app

    tls: dict[str, Any] = {}
    if settings.tls_cert is not None:
        tls = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}
    return server.serve("proxy", build, host=settings.host, port=settings.port,
                        failure_file=settings.start_failure_file, **tls)
