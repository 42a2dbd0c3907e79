"""`sandpool proxy`: the authenticated, multi-tenant edge (see docs/proxy.md)."""

from __future__ import annotations

import argparse
from typing import Any

from sandpool.core.logs import configure_logging
from sandpool.core.settings import add_settings_arguments, dump_settings, settings_from_args
from sandpool.proxy.settings import ProxySettings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("proxy", help="authenticate tokens, apply workspace policy, forward to the scheduler",
                                   description=__doc__)
    add_settings_arguments(parser, ProxySettings)
    # The singular spelling the docs use: --auth-public-key A --auth-public-key B.
    parser.add_argument("--auth-public-key", dest="auth_public_keys", action="append", default=None,
                        help="Same as --auth-public-keys (repeatable)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings: ProxySettings = settings_from_args(ProxySettings, args)
    serve(settings)
    return 0


def serve(settings: ProxySettings) -> None:
    """Run the proxy in this process until interrupted (also used by `sandpool up`)."""
    import logging

    import uvicorn

    from sandpool.core.signals import exit_zero_on_sigterm
    from sandpool.proxy.app import create_app

    configure_logging("proxy", settings.log_level)
    app = create_app(settings)  # refuses to build without a trusted key or the internal credential
    logging.getLogger(__name__).info("configuration", extra={"settings": dump_settings(settings)})
    config: dict[str, Any] = {"host": settings.host, "port": settings.port, "log_config": None,
                              "access_log": False, "lifespan": "on", "server_header": False}
    if settings.tls_cert is not None:
        config.update(ssl_certfile=str(settings.tls_cert), ssl_keyfile=str(settings.tls_key))
    try:
        import uvloop  # noqa: F401

        config["loop"] = "uvloop"
    except ImportError:
        pass
    exit_zero_on_sigterm()
    uvicorn.run(app, **config)
