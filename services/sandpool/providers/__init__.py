"""Providers run sandboxes; the controller sees only `controller.provider.Provider`.

Which providers exist, and how each is configured and built, is `providers.registry`:
`build_provider(kind, settings)` is the one place a provider is chosen. A provider's
settings are picked by field name from whatever settings object the caller has (the
controller's, usually), so one `--data-dir` serves both; anything else comes from its
own `SANDPOOL_*` variables and defaults.
"""

from __future__ import annotations

from typing import Any

from sandpool.controller.provider import Provider
from sandpool.providers import registry


def build_provider(kind: str, settings: Any = None, **overrides: Any) -> Provider:
    """A provider of the given kind, configured from `settings` (fields matched by name) and overrides."""
    return registry.kind(kind).build(settings, **overrides)
