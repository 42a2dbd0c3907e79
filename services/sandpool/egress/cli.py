"""`sandpool egress`: the egress proxy sandboxes reach the network through (see docs/egress.md)."""

from __future__ import annotations

import argparse
from typing import Any

from sandpool.core.settings import add_settings_arguments, settings_from_args
from sandpool.egress.settings import EgressSettings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "egress", help="the egress proxy: sandboxes' HTTP(S) to allow-listed hosts, metered per workspace",
        description=__doc__)
    add_settings_arguments(parser, EgressSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings: EgressSettings = settings_from_args(EgressSettings, args)
    return serve(settings)


def serve(settings: EgressSettings) -> int:
    """Run the egress proxy in this process until interrupted; the exit status (2: it could not start)."""
    from sandpool.core.logs import configure_logging
    from sandpool.egress.serving import serve as run_server

    configure_logging("egress", settings.log_level)
    return run_server(settings)
