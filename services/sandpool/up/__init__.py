"""`sandpool up`: the whole stack on one machine, with the embedded defaults.

Starts, each as a child process in its own process group:
- Redis (unless `--redis-url` names one): a real `redis-server` bound to 127.0.0.1 with a
  generated password, append-only persistence under `<data-dir>/redis`;
- with `--egress-allow-ceiling`, the egress proxy (`sandpool egress`) on a Unix socket in the
  stack's short private socket directory, which the local sandboxes reach through their agents;
- the controller with the local provider (sandboxes under `<data-dir>/sandboxes`), which
  keeps the pool warm and reaps sessions;
- the api, which verifies JWTs against a generated dev key (or `--auth-public-key`), or
  serves one trusted client with `--no-auth`.

A child that dies is started again (with backoff, saying so on stderr): the
sandboxes outlive the controller and the api alike, so a restart ends no session.

When the pool is warm it prints to stdout, and only there: `SANDPOOL_URL=...`, then
(auth on) `SANDPOOL_TOKEN=...`, then a curl line that runs `print(1)` and releases its
session. Logs go to stderr. A start that cannot work says why in one line before
anything starts; SIGTERM or Ctrl-C stops everything it started.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import Any

from sandpool.core.settings import settings_from_args
from sandpool.up.settings import UpSettings, add_arguments, api_flags, controller_flags
from sandpool.up.stack import Stack, curl_line

__all__ = ["Stack", "UpSettings", "curl_line", "register", "run"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "up", help="run the whole stack on this machine (Redis, controller, api, local sandboxes)",
        description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(func=run)


def _pool_names(args: argparse.Namespace) -> list[str]:
    from sandpool.controller.pools import PoolSettings, pools_from_settings

    return [pool.name for pool in pools_from_settings(settings_from_args(PoolSettings, args))]


def run(args: argparse.Namespace) -> int:
    from sandpool.core.logs import configure_logging
    from sandpool.up import environments, preflight

    settings: UpSettings = settings_from_args(UpSettings, args)
    # Everything that can be known to fail is found now: one line, nothing started, no log yet.
    preflight.check_service_settings(args)
    preflight.check_redis(settings)
    data_dir = Path(settings.data_dir).expanduser().absolute()
    preflight.check_data_dir(data_dir)
    stack = Stack(settings, api_flags=api_flags(args), controller_flags=controller_flags(args),
                  pools=_pool_names(args))
    stack.lock_data_dir()
    try:
        preflight.check_key(settings, data_dir)
        preflight.check_port(settings)
        preflight.check_isolation(args)
        # Built on first use, then found in the cache: the sandboxes' Python, handed on as --sandbox-python.
        environments.prepare(args)
    except BaseException:
        stack.unlock_data_dir()
        raise
    stack.controller_flags = controller_flags(args)  # with the sandboxes' Python just prepared
    configure_logging("up", settings.log_level)
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if not stopping.is_set():
            import logging

            logging.getLogger("sandpool.up").info("stopping", extra={"signal": signal.Signals(signum).name})
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        return stack.run(stopping)
    finally:
        stack.stop()
