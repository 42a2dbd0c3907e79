"""`sandpool agent`: the in-sandbox executor's subcommand."""

from __future__ import annotations

import argparse

from sandpool.core.settings import add_settings_arguments, settings_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    from sandpool.agent.settings import AgentSettings

    parser = subparsers.add_parser(
        "agent", help="run one sandbox's tool calls (Python, bash, editor, files)",
        description="Serve one session's tool calls over TCP or a Unix socket. The per-sandbox secret comes "
                    "from SANDPOOL_AGENT_SECRET or --secret-file, never a flag.")
    add_settings_arguments(parser, AgentSettings)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sandpool.agent.server import serve
    from sandpool.agent.settings import AgentSettings
    from sandpool.core.logs import configure_logging

    settings = settings_from_args(AgentSettings, args)
    settings.secret()  # refuse to start without one, before anything else happens
    settings.workspace_dir()
    configure_logging("agent", settings.log_level)
    serve(settings)
    return 0
