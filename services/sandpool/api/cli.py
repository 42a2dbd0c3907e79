"""`sandpool api`: the request path, the edge over the session layer (`--no-auth`: the session layer alone)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from sandpool.api.settings import ApiSettings
from sandpool.core.settings import add_settings_arguments, dump_settings, settings_from_args

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "api", help="serve contract v1 and the admin API: tokens, policy, leases, forwarding",
        description="The api: authenticates bearer tokens, applies each workspace's policy, leases pre-warmed "
                    "sandboxes from Redis and forwards calls to their agents. --no-auth serves one trusted "
                    "client with no tenancy. Secrets come from files or the environment.")
    add_settings_arguments(parser, ApiSettings)
    # The singular spelling the docs use: --auth-public-key A --auth-public-key B.
    parser.add_argument("--auth-public-key", dest="auth_public_keys", action="append", default=None,
                        help="Same as --auth-public-keys (repeatable)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings: ApiSettings = settings_from_args(ApiSettings, args)
    return serve(settings)


def serve(settings: ApiSettings) -> int:
    """Run the api in this process until interrupted; the exit status (2: it could not start)."""
    from sandpool.api.app import create_app
    from sandpool.core import serve as server
    from sandpool.core.logs import configure_logging

    configure_logging("api", settings.log_level)

    def build() -> Any:
        app = create_app(settings)  # refuses to build without a clear mode
        log.info("configuration", extra={"settings": dump_settings(settings)})
        return app

    tls: dict[str, Any] = {}
    if settings.tls_cert is not None:
        tls = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}
    return server.serve("api", build, host=settings.host, port=settings.port, unix_socket=settings.unix_socket,
                        failure_file=settings.start_failure_file, http="httptools", **tls)
