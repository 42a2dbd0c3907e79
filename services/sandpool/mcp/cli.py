"""`sandpool mcp`: the MCP tools over stdio (for desktop clients), calling a sandpool URL.

The URL comes from `--url` or `SANDPOOL_URL`; the token from `SANDPOOL_TOKEN` or a file
(`--token-file`, `SANDPOOL_TOKEN_FILE`), never from a flag value that shows in a process list.
Without a token it calls a `--no-auth` sandpool.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from sandpool.client.config import TOKEN_ENV, URL_ENV
from sandpool.core.settings import ConfigurationError

TOKEN_FILE_ENV = "SANDPOOL_TOKEN_FILE"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("mcp", help="sandpool's tools as an MCP server over stdio (desktop clients)",
                                   description=__doc__.split("\n\n")[0],
                                   epilog=f"{TOKEN_ENV} (the token itself), {TOKEN_FILE_ENV}, {URL_ENV}. "
                                          "Guide: docs/mcp.md.")
    parser.add_argument("--url", default=None, help=f"sandpool's URL [default: none; env {URL_ENV}]")
    parser.add_argument("--token-file", type=Path, default=None,
                        help=f"file holding the bearer token; without one, the token in ${TOKEN_ENV}, and without "
                             f"that a --no-auth sandpool [default: none; env {TOKEN_FILE_ENV}]")
    parser.add_argument("--log-level", default=None, help="level of the log lines on stderr "
                                                          "[default: warning; env SANDPOOL_LOG_LEVEL]")
    parser.set_defaults(func=run)


def token_of(token_file: Path | None) -> str | None:
    """The bearer token: the file's content when a file is named, else `SANDPOOL_TOKEN` (None: no auth)."""
    if token_file is not None:
        try:
            text = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigurationError(f"cannot read the token file {token_file}: {exc.strerror}") from None
        if not text:
            raise ConfigurationError(f"the token file {token_file} is empty")
        return text
    return (os.environ.get(TOKEN_ENV) or "").strip() or None


def run(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get(URL_ENV, "").strip()
    if not url:
        raise ConfigurationError(f"no sandpool URL: pass --url or set {URL_ENV} (sandpool up prints it)")
    token_file = args.token_file or (Path(os.environ[TOKEN_FILE_ENV]) if os.environ.get(TOKEN_FILE_ENV) else None)
    token = token_of(token_file)
    level = args.log_level or os.environ.get("SANDPOOL_LOG_LEVEL") or "warning"
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import anyio

    from sandpool.mcp.stdio import serve

    anyio.run(serve, url, token)
    return 0
