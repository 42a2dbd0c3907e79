"""Egress allow-lists: which destinations a session may reach, and the operator's ceiling over them.

An entry is `HOST[:PORT]`; the port defaults to 443. HOST is one of:

- `files.example.org`: exactly that name (canonical form: `hosts.normalise_name`);
- `*.example.com`: any name strictly below `example.com` (`a.example.com`,
  `a.b.example.com`; not `example.com` itself, not `badexample.com`);
- `*`: any name (meant for an operator's ceiling; a workspace's list under it
  still names its own hosts);
- an address literal (`203.0.113.7`, `[2001:db8::1]`): that address only. An
  address is never matched by a name pattern, `*` included, so a connection to
  a literal address needs a list that names it.

A destination is admitted when the session's list and the ceiling both admit it.
The address policy (`addresses.py`) applies on top, whatever the lists say.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from sandpool.egress.hosts import BadHost, Destination, normalise_name, parse_address, split_authority

DEFAULT_PORT = 443
MAX_ENTRIES = 1024
MAX_ENTRY_LENGTH = 300


class BadEntry(ValueError):
    """An allow-list entry that cannot be read; the message names it."""


@dataclass(frozen=True)
class Rule:
    kind: str  # "exact" | "below" | "any" | "address"
    value: str  # the canonical name, the suffix without "*.", "*", or the address text
    port: int

    def admits(self, destination: Destination) -> bool:
        if destination.port != self.port:
            return False
        host = destination.host
        if self.kind == "address":
            return host.is_literal and host.name == self.value
        if host.is_literal:
            return False
        if self.kind == "exact":
            return host.name == self.value
        if self.kind == "below":
            return host.name.endswith("." + self.value)
        return self.kind == "any"

    def within(self, ceiling: Rule) -> bool:
        """Whether everything this rule admits, `ceiling` admits too."""
        if self.port != ceiling.port:
            return False
        if ceiling.kind == "address" or self.kind == "address":
            return self.kind == ceiling.kind and self.value == ceiling.value
        if ceiling.kind == "any":
            return True
        if self.kind == "any":
            return False
        if ceiling.kind == "exact":
            return self.kind == "exact" and self.value == ceiling.value
        # ceiling "below": an exact name or a narrower-or-equal wildcard underneath it
        if self.kind == "exact":
            return self.value.endswith("." + ceiling.value)
        return self.value == ceiling.value or self.value.endswith("." + ceiling.value)

    def __str__(self) -> str:
        host = {"exact": self.value, "below": "*." + self.value, "any": "*"}.get(self.kind)
        if host is None:
            host = f"[{self.value}]" if ":" in self.value else self.value
        return host if self.port == DEFAULT_PORT else f"{host}:{self.port}"


def parse_entry(entry: str) -> Rule:
    """One entry as a rule, or `BadEntry` saying what is wrong with it."""
    if not isinstance(entry, str) or not entry or len(entry) > MAX_ENTRY_LENGTH or entry != entry.strip():
        raise BadEntry(f"bad egress allow-list entry {entry!r}: expected HOST or HOST:PORT")
    try:
        raw_host, port = split_authority(entry, default_port=DEFAULT_PORT)
        if raw_host == "*":
            return Rule("any", "*", port)
        if raw_host.startswith("*."):
            return Rule("below", normalise_name(raw_host[2:]), port)
        if "*" in raw_host:
            raise BadHost("a wildcard is only allowed as a whole first label (*.example.com)")
        address = parse_address(raw_host)
        if address is not None:
            return Rule("address", str(address), port)
        return Rule("exact", normalise_name(raw_host), port)
    except BadHost as exc:
        raise BadEntry(f"bad egress allow-list entry {entry!r}: {exc}") from None


@dataclass(frozen=True)
class AllowList:
    rules: tuple[Rule, ...]

    def admits(self, destination: Destination) -> bool:
        return any(rule.admits(destination) for rule in self.rules)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __str__(self) -> str:
        return ", ".join(map(str, self.rules)) or "(empty)"


def checked(entries: list[str]) -> list[str]:
    """`entries` unchanged once they parse: a settings validator's check (`BadEntry` is a ValueError)."""
    parse(entries)
    return entries


def parse(entries: Iterable[str]) -> AllowList:
    """A list of entries as an allow-list; `BadEntry` for the first bad one (an operator's input)."""
    items = list(entries)
    if len(items) > MAX_ENTRIES:
        raise BadEntry(f"too many egress allow-list entries ({len(items)} > {MAX_ENTRIES})")
    return AllowList(tuple(dict.fromkeys(parse_entry(entry) for entry in items)))


@lru_cache(maxsize=4096)
def from_stored(raw: str) -> AllowList:
    """A session's allow-list as the lease stored it (a JSON list). Unreadable means empty: a broken
    record admits nothing rather than everything. Cached: many connections share one list."""
    try:
        entries = json.loads(raw) if raw else []
    except ValueError:
        return AllowList(())
    if not isinstance(entries, list):
        return AllowList(())
    rules = []
    for entry in entries[:MAX_ENTRIES]:
        try:
            rules.append(parse_entry(entry))
        except BadEntry:
            continue  # one unreadable entry admits nothing; the others still count
    return AllowList(tuple(dict.fromkeys(rules)))


def outside_ceiling(entries: Iterable[str], ceiling: AllowList) -> list[str]:
    """The entries of a workspace's list the ceiling does not wholly cover, each with why; for the
    admin API to refuse a policy (422) rather than store a list the proxy would only half honour.
    Raises `BadEntry` for an unreadable entry."""
    out = []
    for entry in entries:
        rule = parse_entry(entry)
        if not any(rule.within(limit) for limit in ceiling.rules):
            out.append(f"{entry} is outside the installation's egress ceiling")
    return out
