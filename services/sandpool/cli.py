"""`sandpool up | api | controller | agent | egress | mcp | keygen | token | admin`.

Each subcommand lives next to its service (`<service>/cli.py` exposes
`register(subparsers)`); this module only wires them together, importing each
lazily so `sandpool agent` inside a sandbox never imports the control plane.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sandpool import __version__
from sandpool.core.redact import redact
from sandpool.core.settings import ConfigurationError

# subcommand -> module whose `register(subparsers)` adds it
COMMANDS = {
    "up": "sandpool.up",
    "api": "sandpool.api.cli",
    "controller": "sandpool.controller.cli",
    "agent": "sandpool.agent.cli",
    "egress": "sandpool.egress.cli",
    "mcp": "sandpool.mcp.cli",
    "keygen": "sandpool.edge.keys_cli",
    "token": "sandpool.edge.keys_cli",
    "admin": "sandpool.client.admin_cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandpool", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sandpool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    registered: set[str] = set()
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            continue
        if module in registered:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # a slim install (the sandbox image) lacks the control plane
            sub.add_parser(name, help=f"(unavailable: {exc.name} is not installed)")
            continue
        mod.register(sub)
        registered.add(module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigurationError as exc:
        print(f"sandpool {args.command}: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
