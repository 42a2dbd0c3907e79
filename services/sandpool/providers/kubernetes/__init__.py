"""The Kubernetes provider: sandboxes are pods (see docs/kubernetes.md).

Importing this package imports nothing heavy: `provider` (and what it imports) needs the
`kubernetes` client (the `kubernetes` extra), `settings` and `pool_options` do not, so the
registry can list this provider's flags and check a pools file without the client.
`KubernetesProvider` and `KubernetesProviderSettings` are importable from here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KubernetesProvider", "KubernetesProviderSettings"]


def __getattr__(name: str) -> Any:
    if name == "KubernetesProvider":
        from sandpool.providers.kubernetes.provider import KubernetesProvider

        return KubernetesProvider
    if name == "KubernetesProviderSettings":
        from sandpool.providers.kubernetes.settings import KubernetesProviderSettings

        return KubernetesProviderSettings
    raise AttributeError(name)
