"""Name resolution, done by the proxy itself so that the addresses it checks are the ones it dials.

A client never tells the proxy an address for a name: the proxy resolves the
CONNECT authority or the URL's host, checks every address (`addresses.py`),
and connects to a checked address, so a rebinding DNS answer cannot slip an
internal address in between check and use. `StaticResolver` answers some names
from a fixed table first (`--resolve-overrides`, like curl's `--resolve`): the
test suite maps its test names to loopback servers through it, never through
/etc/hosts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Mapping
from typing import Protocol

from sandpool.egress.hosts import IPAddress, normalise_name


class ResolveFailed(Exception):
    """The name has no address (or the resolver failed); the message says which."""


class Resolver(Protocol):
    async def resolve(self, name: str) -> list[IPAddress]:
        """Every address of a canonical name (`hosts.normalise_name`), or `ResolveFailed`."""
        ...


class SystemResolver:
    """The host's resolver (getaddrinfo in the event loop's executor), bounded by a timeout."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    async def resolve(self, name: str) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(name, None, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP), self.timeout)
        except TimeoutError:
            raise ResolveFailed(f"resolving {name} timed out") from None
        except (socket.gaierror, UnicodeError, OSError) as exc:
            raise ResolveFailed(f"cannot resolve {name} ({getattr(exc, 'strerror', None) or exc})") from None
        out: list[IPAddress] = []
        for _family, _type, _proto, _canon, sockaddr in infos:
            text = str(sockaddr[0])
            try:
                address = ipaddress.ip_address(text)
            except ValueError:
                # A scoped IPv6 address ("fe80::1%eth0") is link-local anyway: keep it, the policy refuses it.
                address = ipaddress.ip_address(text.split("%", 1)[0])
            if address not in out:
                out.append(address)
        if not out:
            raise ResolveFailed(f"{name} has no address")
        return out


def parse_overrides(entries: Iterable[str]) -> dict[str, list[IPAddress]]:
    """`name=address` entries (a name may repeat) as a table; `ValueError` naming a bad entry."""
    table: dict[str, list[IPAddress]] = {}
    for entry in entries:
        name, eq, text = entry.partition("=")
        if not eq:
            raise ValueError(f"expected NAME=ADDRESS, got {entry!r}")
        try:
            key = normalise_name(name.strip())
            address = ipaddress.ip_address(text.strip().strip("[]"))
        except ValueError as exc:
            raise ValueError(f"bad resolve override {entry!r}: {exc}") from None
        table.setdefault(key, [])
        if address not in table[key]:
            table[key].append(address)
    return table


class StaticResolver:
    """Fixed answers for some names; the others go to `fallback` (or fail when there is none)."""

    def __init__(self, table: Mapping[str, list[IPAddress]], fallback: Resolver | None = None) -> None:
        self.table = {name: list(addresses) for name, addresses in table.items()}
        self.fallback = fallback

    async def resolve(self, name: str) -> list[IPAddress]:
        found = self.table.get(name)
        if found:
            return list(found)
        if self.fallback is None:
            raise ResolveFailed(f"cannot resolve {name}")
        return await self.fallback.resolve(name)
