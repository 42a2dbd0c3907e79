"""Workspace policy: what an admin stored, bounded by the operator's ceilings.

The policy's limit fields are the catalogue's (`contract/limits.py`): the model
is built from it, and so are the limits the edge hands the session layer. A
stored policy may only lower a ceiling: a PUT with a value above one is refused
(422) rather than clamped, so the admin learns at once. A field left unset
inherits the ceiling. The ceilings are the api's own settings, held in process:
the session layer's (lifetimes, timeouts, concurrency, budget) and the edge's
(the request rate).

The egress allow-list (`egress_allow`) is the one list: unset or empty means no
egress at all (it never inherits the ceiling), each entry is checked with the
egress proxy's own parser, and the admin API refuses entries outside the ceiling
the egress proxy published. It reaches the session layer as a tuple, with the principal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model

from sandpool.contract import limits as catalogue
from sandpool.egress import allowlist

LimitValue = Annotated[int, Field(ge=1, le=catalogue.MAX_VALUE)] | None
MAX_IMAGES = 256


def _egress_entries(value: list[str] | None) -> list[str] | None:
    """Every entry as the egress proxy reads it (`HOST[:PORT]`, `*.domain`), or a 422 naming the bad one.
    Stored in the egress proxy's canonical form (IDNA as ASCII, lower case, port 443 implied, duplicates
    dropped): what is shown is what is enforced."""
    if value is None:
        return None
    try:
        return [str(rule) for rule in allowlist.parse(value).rules]
    except allowlist.BadEntry as exc:
        raise ValueError(str(exc)) from None


LIST_CHECKS = {"egress_allow": _egress_entries}
"""The check of each list limit's entries, by name."""


def _list_field(limit: catalogue.Limit) -> tuple[Any, Any]:
    entry = Annotated[str, Field(min_length=1, max_length=catalogue.MAX_LIST_ENTRY_LENGTH)]
    check = LIST_CHECKS.get(limit.name, lambda value: value)
    return (Annotated[list[entry] | None, AfterValidator(check)],
            Field(default=None, max_length=catalogue.MAX_LIST_ENTRIES, description=limit.description))


@lru_cache(maxsize=8)
def _model_for(limits: tuple[catalogue.Limit, ...]) -> type[BaseModel]:
    fields: dict[str, Any] = {
        "allowed_images": (list[Annotated[str, Field(min_length=1, max_length=512)]] | None, Field(
            default=None, max_length=MAX_IMAGES,
            description="Images a CreateSession may name (null: any; a request naming none gets the default pool)")),
    }
    for limit in limits:
        if limit.is_list:
            fields[limit.name] = _list_field(limit)
        else:
            fields[limit.name] = (LimitValue, Field(default=None, description=limit.description))
    return create_model("Policy", __config__=ConfigDict(extra="forbid"),
                        __doc__="A workspace's policy. Unset (null) fields inherit the operator's ceiling.",
                        **fields)


def policy_model() -> type[BaseModel]:
    """The policy model of the catalogue as it is now (built once per catalogue)."""
    return _model_for(catalogue.LIMITS)


def limit_values(policy: BaseModel) -> dict[str, int]:
    """The policy's numeric limit values by name (unset: 0)."""
    return {limit.name: int(getattr(policy, limit.name, None) or 0) for limit in catalogue.counts()}


def list_values(policy: BaseModel) -> dict[str, list[str]]:
    """The policy's list values by name (unset: empty, which for egress means none)."""
    return {limit.name: list(getattr(policy, limit.name, None) or []) for limit in catalogue.lists()}


def above_ceilings(policy: BaseModel, ceilings: Mapping[str, int]) -> list[str]:
    """Human-readable violations: each field whose value exceeds a (non-zero) ceiling."""
    out = []
    for name, value in limit_values(policy).items():
        ceiling = int(ceilings.get(name) or 0)
        if ceiling and value > ceiling:
            out.append(f"{name}={value} is above the operator's ceiling {ceiling}")
    return out


@dataclass(frozen=True)
class Effective:
    """One workspace's admission values: its image allow-list, its rate in force, and its own values of
    the limits the session layer enforces (which bounds them by the operator's ceilings)."""

    allowed_images: frozenset[str] | None
    requests_per_minute: int
    limits: Mapping[str, int]
    """The workspace's own value of each count the session layer enforces (0: none of its own)."""
    egress_allow: tuple[str, ...]
    """The destinations its sessions may reach through the egress proxy (empty: none)."""


def egress_outside(entries: list[str], ceiling: list[str] | None) -> list[str]:
    """Why each entry of a workspace's egress allow-list is refused by the ceiling the egress proxy
    published (None: none published, so no entry is allowed); empty when all are within it."""
    if not entries:
        return []
    if ceiling is None:
        return ["egress_allow: no egress proxy has published a ceiling, so this installation has no egress "
                "(start `sandpool egress --egress-allow-ceiling ...`; docs/egress.md)"]
    try:
        bound = allowlist.parse(ceiling)
    except allowlist.BadEntry:
        return ["egress_allow: the egress ceiling published in Redis is unreadable; restart the egress proxy"]
    return [f"egress_allow: {why}" for why in allowlist.outside_ceiling(entries, bound)]


def effective(policy: BaseModel, proxy_ceilings: Mapping[str, int]) -> Effective:
    values = limit_values(policy)
    lists = list_values(policy)
    own = {limit.name: values[limit.name] for limit in catalogue.counts(catalogue.handed_over())}
    rate = catalogue.combine(values.get("requests_per_minute", 0), int(proxy_ceilings.get("requests_per_minute") or 0))
    allowed = policy.allowed_images  # type: ignore[attr-defined]  # a field of policy_model(), built at run time
    images = frozenset(allowed) if allowed is not None else None
    return Effective(allowed_images=images, requests_per_minute=rate, limits=own,
                     egress_allow=tuple(lists.get("egress_allow", ())))


class CorruptPolicy(ValueError):
    """The stored record does not parse: the workspace is refused (fail closed), never unlimited."""


def load_policy(raw: str | bytes | None) -> BaseModel:
    model = policy_model()
    if not raw:
        return model()
    try:
        return model.model_validate(json.loads(raw))
    except (ValueError, ValidationError):
        raise CorruptPolicy("the workspace's stored policy is unreadable") from None


def dump_policy(policy: BaseModel) -> str:
    return policy.model_dump_json()


class PolicyCodec:
    """Stored JSON → admission values, memoised on the exact stored text (a Redis GET per request is
    exact; re-parsing the same JSON each time is the part worth skipping)."""

    def __init__(self, proxy_ceilings: Mapping[str, int]) -> None:
        self.proxy_ceilings = dict(proxy_ceilings)
        self.default = effective(policy_model()(), proxy_ceilings)
        self._decode = lru_cache(maxsize=4096)(self._decode_uncached)

    def _decode_uncached(self, raw: str) -> Effective:
        return effective(load_policy(raw), self.proxy_ceilings)

    def decode(self, raw: str | None) -> Effective:
        return self._decode(raw) if raw else self.default


def proxy_ceilings_of(settings: Any) -> dict[str, int]:
    """The ceilings the edge itself holds (of the limits it enforces), by catalogue name."""
    return {limit.name: int(getattr(settings, limit.ceiling, 0) or 0) for limit in catalogue.counts()
            if limit.ceiling_owner == "proxy"}
