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
become a default. The keys only one provider reads (`node_selector`,
`tolerations`, `workspace_size` for Kubernetes) are that provider's pool options,
declared in its package and found through `providers.registry`; the file is
validated once with every provider's options beside the common fields, and each
pool carries them typed in `PoolSpec.options[provider]`.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from sandpool.controller.provider import PoolSpec
from sandpool.controller.quantities import parse_quantity, positive_quantity
from sandpool.core.settings import ConfigurationError
from sandpool.providers import registry

__all__ = ["PoolTemplate", "load_environments", "load_pools", "parse_pools", "parse_quantity"]

# A pool name ends up in Kubernetes label values and object names, so it is a DNS label.
POOL_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


class _Strict(BaseModel):
    # A misspelt key is an error that names it, never a silently ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ResourceAmounts(_Strict):
    cpu: str | None = Field(default=None, description="CPU, e.g. 250m or 2")
    memory: str | None = Field(default=None, description="memory, e.g. 256Mi or 1Gi")

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _amount(cls, value: Any) -> Any:
        return None if value is None else positive_quantity(value)


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

    @field_validator("egress")
    @classmethod
    def _egress(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("a pool no longer opens egress: sandboxes reach the network only through the egress "
                             "proxy, as each workspace's policy (egress_allow) allows; remove `egress: true` "
                             "(docs/helm.md, \"Migrating egress\")")
        return value

    @model_validator(mode="after")
    def _warm_within_ceiling(self) -> PoolTemplate:
        if self.warm > self.ceiling:
            raise ValueError(f"warm ({self.warm}) is above ceiling ({self.ceiling})")
        if self.max_warm is not None and not self.warm <= self.max_warm <= self.ceiling:
            raise ValueError(f"max_warm ({self.max_warm}) must be between warm ({self.warm}) and ceiling "
                             f"({self.ceiling})")
        return self

    def to_spec(self) -> PoolSpec:
        """The pool as providers see it: the common fields, and each provider's options typed (taken
        from this already validated template, not validated again)."""
        options = {}
        for name, kind in registry.PROVIDERS.items():
            cls = kind.pool_options_class()
            options[name] = cls.model_construct(**{field: getattr(self, field) for field in cls.model_fields})
        return PoolSpec(
            name=self.name, image=self.image, warm=self.warm, ceiling=self.ceiling, max_warm=self.max_warm,
            cpu=self.resources.limits.cpu, memory=self.resources.limits.memory,
            cpu_request=self.resources.requests.cpu, memory_request=self.resources.requests.memory,
            runtime_class=self.runtime_class, command=tuple(self.command), args=tuple(self.args),
            options=options,
        )


@functools.cache
def pool_model() -> type[PoolTemplate]:
    """The model a pool of the file is validated with: the common fields and every registered
    provider's options (one provider's key is accepted for all: one file serves any provider)."""
    bases: tuple[type[BaseModel], ...] = (
        PoolTemplate, *(kind.pool_options_class() for kind in registry.PROVIDERS.values()))
    return cast("type[PoolTemplate]", create_model("PoolTemplate", __base__=bases))


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


@functools.cache
def pools_file_model() -> type[PoolsFile]:
    pools: Any = list[pool_model()]  # type: ignore[misc]  # a model made at run time
    return cast("type[PoolsFile]", create_model("PoolsFile", __base__=PoolsFile, pools=(pools, Field(min_length=1))))


def _validate(data: Any, source: str) -> PoolsFile:
    try:
        return pools_file_model().model_validate(data)
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
