"""Providers run sandboxes; the controller and scheduler see only `pool.provider.Provider`.

`build_provider(kind, settings)` is the one place a provider is chosen. The
local provider's settings are picked by field name from whatever settings
object the caller has (the scheduler's, usually), so one `--data-dir` serves
both; anything else comes from its own `SANDPOOL_*` variables and defaults.
The Kubernetes provider is imported only when asked for: the `kubernetes`
client is an optional dependency.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel

from sandpool.pool.provider import Provider

KINDS = ("local", "kubernetes")


def _pick(settings_cls: type[BaseModel], settings: Any, overrides: dict[str, Any]) -> Any:
    given: dict[str, Any] = {}
    if settings is not None:
        for name in settings_cls.model_fields:
            value = getattr(settings, name, None)
            if value is not None:
                given[name] = value
    given.update(overrides)
    return settings_cls(**given)


def build_provider(kind: str, settings: Any = None, **overrides: Any) -> Provider:
    """A provider of the given kind, configured from `settings` (fields matched by name) and overrides."""
    if kind == "local":
        from sandpool.providers.local.provider import LocalProvider
        from sandpool.providers.local.settings import LocalProviderSettings

        if isinstance(settings, LocalProviderSettings) and not overrides:
            return LocalProvider(settings)
        return LocalProvider(_pick(LocalProviderSettings, settings, overrides))
    if kind == "kubernetes":
        module = importlib.import_module("sandpool.providers.kubernetes")
        return module.build_provider(settings, **overrides)
    raise ValueError(f"unknown provider {kind!r} (expected one of {', '.join(KINDS)})")
