"""Every provider sandpool can run, each declared once: its settings, its factory, its pool options.

The controller's `--provider` choices and flags, `sandpool up`, the pools file and the
docs all read this table, so a new provider is one entry here plus its package. Entries
name their parts as `module:attribute` strings, imported only when asked for: the
Kubernetes provider's factory pulls in the optional `kubernetes` client, while its
settings and pool options import nothing heavy (a pools file is checked, and `--help`
lists every provider's flags, without it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from sandpool.core.settings import ConfigurationError, ServiceSettings, describe_validation_error

if TYPE_CHECKING:
    from sandpool.controller.provider import Provider


def _load(reference: str) -> Any:
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class ProviderKind:
    name: str
    summary: str
    settings: str
    """`module:Class` of the provider's own settings (its flags and `SANDPOOL_*` variables)."""
    factory: str
    """`module:function` taking those settings and returning a `pool.provider.Provider`."""
    pool_options: str
    """`module:Class` of the pools-file keys only this provider reads (typed, validated with the file)."""
    extra: str = ""
    """The package extra the factory needs (named in the error when it is missing)."""

    def settings_class(self) -> type[ServiceSettings]:
        cls: type[ServiceSettings] = _load(self.settings)
        return cls

    def pool_options_class(self) -> type[BaseModel]:
        cls: type[BaseModel] = _load(self.pool_options)
        return cls

    def build(self, settings: Any = None, **overrides: Any) -> Provider:
        """The provider, configured from its own settings object, or from any settings object whose
        fields it shares by name (the controller's `data_dir`), plus overrides."""
        cls = self.settings_class()
        own = settings if isinstance(settings, cls) and not overrides else settings_from(cls, settings, overrides)
        try:
            factory = _load(self.factory)
        except ImportError as exc:
            hint = f" (install sandpool[{self.extra}])" if self.extra else ""
            raise ConfigurationError(f"the {self.name} provider cannot be loaded: {exc}{hint}") from None
        provider: Provider = factory(own)
        return provider


PROVIDERS: dict[str, ProviderKind] = {kind.name: kind for kind in (
    ProviderKind(
        name="local",
        summary="sandboxes as isolated processes on this machine (namespaces, cgroups, seccomp)",
        settings="sandpool.providers.local.settings:LocalProviderSettings",
        factory="sandpool.providers.local.provider:LocalProvider",
        pool_options="sandpool.providers.local.pool_options:LocalPoolOptions",
    ),
    ProviderKind(
        name="kubernetes",
        summary="sandboxes as pods of a Kubernetes cluster",
        settings="sandpool.providers.kubernetes.settings:KubernetesProviderSettings",
        factory="sandpool.providers.kubernetes.provider:KubernetesProvider",
        pool_options="sandpool.providers.kubernetes.pool_options:KubernetesPoolOptions",
        extra="kubernetes",
    ),
    ProviderKind(
        name="simulated",
        summary=("no sandboxes: records only, one server process answering every agent call with a fixed "
                 "result (benchmarks and tests of the control plane; runs no code)"),
        settings="sandpool.providers.simulated.settings:SimulatedProviderSettings",
        factory="sandpool.providers.simulated.provider:SimulatedProvider",
        pool_options="sandpool.providers.simulated.pool_options:SimulatedPoolOptions",
    ),
)}


def names() -> tuple[str, ...]:
    return tuple(PROVIDERS)


def kind(name: str) -> ProviderKind:
    try:
        return PROVIDERS[name]
    except KeyError:
        raise ConfigurationError(f"unknown provider {name!r} (expected one of {', '.join(PROVIDERS)})") from None


def settings_from(cls: type[ServiceSettings], settings: Any, overrides: dict[str, Any]) -> ServiceSettings:
    """`cls` from the fields of `settings` it shares by name (unset ones left to `cls`), then overrides."""
    given: dict[str, Any] = {}
    if settings is not None:
        for name in cls.model_fields:
            value = getattr(settings, name, None)
            if value is not None:
                given[name] = value
    given.update(overrides)
    try:
        return cls(**given)
    except ValidationError as exc:
        raise ConfigurationError(describe_validation_error(exc)) from None
