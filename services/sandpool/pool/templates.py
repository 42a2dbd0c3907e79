"""Pool templates: the operator's YAML file of pools, validated at start.

`load_pools(path)` reads a file such as `deploy/pools/default.yaml`:

```yaml
pools:
  - name: python                 # [a-z0-9-], unique; labels and metrics carry it
    image: ghcr.io/example/sandpool-sandbox:0.1.0
    command: [sandpool, agent]   # optional: how the image starts the agent
    args: [--max-output-bytes, "1048576"]  # optional: extra agent flags, appended
    resources:
      requests: {cpu: 250m, memory: 256Mi}
      limits: {cpu: "1", memory: 1Gi}
    warm: 50                     # sandboxes kept ready whatever the demand (the floor)
    max_warm: 120                # most kept ready when demand asks for more (the cap; default: warm)
    ceiling: 200                 # most sandboxes of this pool at once
    runtime_class: gvisor        # optional RuntimeClass (gVisor, Kata)
    node_selector: {sandpool.dev/sandbox: "true"}
    tolerations:
      - {key: sandpool.dev/sandbox, operator: Equal, value: "true", effect: NoSchedule}
    workspace_size: 1Gi          # size limit of the writable workspace volume
```

(Egress is per workspace, through the egress proxy: docs/egress.md. The old
`egress: true` of a pool is refused with a pointer there; `egress: false` is
accepted and means nothing.)

Local sandboxes run their code on a named environment (docs/sandboxes.md): a pool's
`image` names it, `python` (built from the sandbox image's lock) unless the file
declares others:

```yaml
environments:                    # local provider only; Kubernetes pools run their image
  - name: python-ml              # what a pool's `image` (and a CreateSession `image` hint) names
    requirements: ml.txt         # a lock with hashes, relative to this file
    preimport: [numpy, pandas]   # optional: imported before the first call
    pip: true                    # optional: `pip install` into a per-session layer, through egress
pools:
  - {name: ml, image: python-ml, warm: 2, ceiling: 8}
```

A bad file stops the start with a `ConfigurationError` naming the file and the
field (`pools[1].resources.limits.memory: ...`): a typo must never silently
become a default. Nothing here imports a provider; the Kubernetes-only values
travel in `PoolSpec.extra` under the keys in `EXTRA_KEYS`, as plain JSON-able
values, so any provider (or a log line) can read them.
"""

from __future__ import annotations

import os
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sandpool.core.settings import ConfigurationError
from sandpool.pool.provider import PoolSpec

# A pool name ends up in Kubernetes label values and object names, so it is a DNS label.
POOL_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")

# Kubernetes quantity: a signed decimal number with an optional SI, binary or exponent suffix.
_QUANTITY = re.compile(r"^(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)"
                       r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_SUFFIX = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}
# Label keys and values as the API server accepts them (prefix/name; value up to 63 chars).
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")

EXTRA_KEYS = ("cpu_request", "memory_request", "node_selector", "tolerations", "workspace_size")
"""What `PoolSpec.extra` carries from a template, beyond PoolSpec's own fields."""

DEFAULT_WORKSPACE_SIZE = "1Gi"


def parse_quantity(text: str) -> Decimal:
    """The value of a Kubernetes quantity (`250m` -> 0.25, `1Gi` -> 1073741824)."""
    match = _QUANTITY.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 500m, 2, 256Mi, 1Gi)")
    suffix = match["suffix"] or ""
    try:
        number = Decimal(match["number"])
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None
    if suffix[:1] in ("e", "E"):
        return number * (Decimal(10) ** int(suffix[1:]))
    return number * _SUFFIX[suffix]


def _quantity(value: Any) -> Any:
    # YAML reads `cpu: 1` as an int and `cpu: 0.5` as a float; both are fine quantities.
    if isinstance(value, bool):
        raise ValueError("must be a quantity such as 500m or 1Gi, not a boolean")
    if isinstance(value, (int, float)):
        value = format(Decimal(str(value)), "f")
    if not isinstance(value, str):
        raise ValueError("must be a quantity such as 500m or 1Gi")
    if parse_quantity(value) <= 0:
        raise ValueError(f"{value!r} must be greater than zero")
    return value.strip()


class _Strict(BaseModel):
    # A misspelt key is an error that names it, never a silently ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ResourceAmounts(_Strict):
    cpu: str | None = Field(default=None, description="CPU, e.g. 250m or 2")
    memory: str | None = Field(default=None, description="memory, e.g. 256Mi or 1Gi")

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _amount(cls, value: Any) -> Any:
        return None if value is None else _quantity(value)


class Resources(_Strict):
    requests: ResourceAmounts = ResourceAmounts()
    limits: ResourceAmounts = ResourceAmounts()

    @model_validator(mode="after")
    def _requests_within_limits(self) -> Resources:
        for what in ("cpu", "memory"):
            request, limit = getattr(self.requests, what), getattr(self.limits, what)
            if request is not None and limit is not None and parse_quantity(request) > parse_quantity(limit):
                raise ValueError(f"requests.{what} ({request}) is above limits.{what} ({limit})")
        return self


class Toleration(_Strict):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0, alias="tolerationSeconds")

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.key is None and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("toleration_seconds applies only to effect NoExecute")
        return self

    def as_api(self) -> dict[str, Any]:
        """The toleration as the Kubernetes API spells it (camelCase, unset fields omitted)."""
        out: dict[str, Any] = {"operator": self.operator}
        if self.key is not None:
            out["key"] = self.key
        if self.value is not None:
            out["value"] = self.value
        if self.effect is not None:
            out["effect"] = self.effect
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


class PoolTemplate(_Strict):
    """One pool as the operator writes it."""

    name: str = Field(description="pool name: lowercase letters, digits and '-', at most 40 characters")
    image: str = Field(min_length=1, description="sandbox image; also the CreateSession `image` hint it serves")
    command: list[str] = Field(default_factory=list, description="how the image starts the agent "
                               "(default: sandpool agent)")
    args: list[str] = Field(default_factory=list, description="extra agent flags, after the provider's own")
    resources: Resources = Resources()
    warm: int = Field(default=2, ge=0, description="sandboxes kept ready whatever the demand (the floor)")
    max_warm: int | None = Field(default=None, ge=0, description=(
        "most kept ready when demand asks for more (the cap; default: warm, a fixed target)"))
    ceiling: int = Field(default=16, ge=1, description="most sandboxes of this pool at once")
    runtime_class: str | None = Field(default=None, description="Kubernetes RuntimeClass, e.g. gvisor or kata")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    workspace_size: str = Field(default=DEFAULT_WORKSPACE_SIZE, description="size limit of the workspace volume")
    egress: bool | None = Field(default=None, description=(
        "removed: egress is allowed per workspace through the egress proxy (docs/egress.md); only false is "
        "accepted, and it means nothing"))

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not POOL_NAME.match(value):
            raise ValueError(f"{value!r} must be 1-40 lowercase letters, digits or '-', starting and "
                             "ending with a letter or digit")
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        if value != value.strip() or any(c.isspace() for c in value):
            raise ValueError("an image reference contains no whitespace")
        return value

    @field_validator("command", "args")
    @classmethod
    def _words(cls, value: list[str]) -> list[str]:
        if any(not isinstance(word, str) or word == "" for word in value):
            raise ValueError("every word must be a non-empty string")
        return value

    @field_validator("runtime_class")
    @classmethod
    def _runtime_class(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", value):
            raise ValueError(f"{value!r} is not a RuntimeClass name")
        return value

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a label key")
            if not isinstance(val, str) or not _LABEL_VALUE.match(val):
                raise ValueError(f"value of {key!r} is not a label value (quote it: \"true\")")
        return value

    @field_validator("egress")
    @classmethod
    def _egress(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("a pool no longer opens egress: sandboxes reach the network only through the egress "
                             "proxy, as each workspace's policy (egress_allow) allows; remove `egress: true` "
                             "(docs/helm.md, \"Migrating egress\")")
        return value

    @field_validator("workspace_size", mode="before")
    @classmethod
    def _workspace_size(cls, value: Any) -> Any:
        return _quantity(value)

    @model_validator(mode="after")
    def _warm_within_ceiling(self) -> PoolTemplate:
        if self.warm > self.ceiling:
            raise ValueError(f"warm ({self.warm}) is above ceiling ({self.ceiling})")
        if self.max_warm is not None and not self.warm <= self.max_warm <= self.ceiling:
            raise ValueError(f"max_warm ({self.max_warm}) must be between warm ({self.warm}) and ceiling "
                             f"({self.ceiling})")
        return self

    def to_spec(self) -> PoolSpec:
        """The provider-neutral pool. Limits are PoolSpec's cpu/memory; the rest goes to `extra`."""
        extra: dict[str, object] = {
            "cpu_request": self.resources.requests.cpu,
            "memory_request": self.resources.requests.memory,
            "node_selector": dict(self.node_selector),
            "tolerations": [t.as_api() for t in self.tolerations],
            "workspace_size": self.workspace_size,
        }
        return PoolSpec(
            name=self.name, image=self.image, warm=self.warm, ceiling=self.ceiling, max_warm=self.max_warm,
            cpu=self.resources.limits.cpu, memory=self.resources.limits.memory,
            runtime_class=self.runtime_class, command=tuple(self.command), args=tuple(self.args),
            extra=extra,
        )


_ENVIRONMENT_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class EnvironmentTemplate(_Strict):
    """A local sandbox environment: a venv built from a requirements lock, named by pools' `image`."""

    name: str = Field(description="the name a pool's `image` gives (lowercase letters, digits, '.', '_', '-')")
    requirements: Path = Field(description="requirements lock with hashes, relative to the pools file")
    preimport: list[str] = Field(default_factory=list, description=(
        "modules the sandbox's interpreter imports before the first call (start time and memory for "
        "a fast first import)"))
    pip: bool = Field(default=False, description=(
        "let `pip install` in a session install into a layer of the session's own (the shared environment "
        "stays read-only) when the workspace's egress allow-list admits the package index"))

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _ENVIRONMENT_NAME.match(value):
            raise ValueError(f"{value!r} must be 1-64 lowercase letters, digits, '.', '_' or '-', starting and "
                             "ending with a letter or digit")
        return value

    @field_validator("preimport")
    @classmethod
    def _modules(cls, value: list[str]) -> list[str]:
        for name in value:
            if not isinstance(name, str) or not _MODULE.match(name):
                raise ValueError(f"{name!r} is not a module name such as numpy or matplotlib.pyplot")
        return value


class PoolsFile(_Strict):
    environments: list[EnvironmentTemplate] = Field(default_factory=list)
    pools: list[PoolTemplate] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_environments(self) -> PoolsFile:
        seen: set[str] = set()
        for environment in self.environments:
            if environment.name in seen:
                raise ValueError(f"environment name {environment.name!r} appears twice")
            seen.add(environment.name)
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> PoolsFile:
        seen: set[str] = set()
        for pool in self.pools:
            if pool.name in seen:
                raise ValueError(f"pool name {pool.name!r} appears twice")
            seen.add(pool.name)
        return self


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _validate(data: Any, source: str) -> PoolsFile:
    try:
        return PoolsFile.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{_where(err['loc'])}: {msg}")
        raise ConfigurationError(f"{source}: invalid pools: " + "; ".join(lines)) from None


def parse_pools(data: Any, *, source: str = "pools file") -> list[PoolSpec]:
    """Validate already-parsed YAML/JSON; `ConfigurationError` names each bad field."""
    return [pool.to_spec() for pool in _validate(data, source).pools]


def load_pools(path: str | Path) -> list[PoolSpec]:
    """The pools of a YAML file, in file order (the first is the default pool)."""
    return parse_pools(_read(path), source=f"pools file {path}")


def load_environments(path: str | Path) -> list[EnvironmentTemplate]:
    """The environments a pools file declares, their locks made absolute (relative to the file) and
    checked to be readable files: a wrong path stops the start, it never falls back to `python`."""
    path = Path(path)
    parsed = _validate(_read(path), f"pools file {path}")
    found = []
    for i, environment in enumerate(parsed.environments):
        lock = (path.absolute().parent / environment.requirements.expanduser())
        if not lock.is_file() or not os.access(lock, os.R_OK):
            raise ConfigurationError(f"pools file {path}: environments[{i}].requirements: {lock} is not a "
                                     "readable file")
        found.append(environment.model_copy(update={"requirements": lock}))
    return found


def _read(path: str | Path) -> Any:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"cannot read pools file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigurationError(f"pools file {path} is not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigurationError(f"pools file {path}: {problem}{where}") from None
    if data is None:
        raise ConfigurationError(f"pools file {path} is empty: it needs a `pools:` list")
    return data
