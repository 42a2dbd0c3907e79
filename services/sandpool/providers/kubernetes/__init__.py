"""The Kubernetes provider: sandboxes are pods (see docs/kubernetes.md).

Importing this package imports the `kubernetes` client (the `kubernetes` extra);
`sandpool.providers.build_provider("kubernetes", ...)` imports it only when asked.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sandpool.core.settings import ConfigurationError, describe_validation_error
from sandpool.providers.kubernetes.provider import KubernetesProvider
from sandpool.providers.kubernetes.settings import KubernetesProviderSettings

__all__ = ["KubernetesProvider", "KubernetesProviderSettings", "build_provider"]


def build_provider(settings: Any = None, **overrides: Any) -> KubernetesProvider:
    """A provider from `KubernetesProviderSettings`, or from any settings object with the same field names."""
    if isinstance(settings, KubernetesProviderSettings) and not overrides:
        return KubernetesProvider(settings)
    given: dict[str, Any] = {}
    if settings is not None:
        for name in KubernetesProviderSettings.model_fields:
            value = getattr(settings, name, None)
            if value is not None:
                given[name] = value
    given.update(overrides)
    try:
        return KubernetesProvider(KubernetesProviderSettings(**given))
    except ValidationError as exc:
        raise ConfigurationError(describe_validation_error(exc)) from None
