"""A new provider is one registry entry: the controller, its flags and the pools file find it there.

The dummy provider below is declared only in this file and registered for one test;
nothing else in the code base is touched, and it reaches `--provider`, the controller's
flags, `build_provider` and the pools file (its options typed, validated with the file).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandpool.cli import build_parser
from sandpool.controller.settings import ControllerSettings
from sandpool.controller.templates import parse_pools, pool_model, pools_file_model
from sandpool.core.settings import ConfigurationError, ServiceSettings, settings_from_args
from sandpool.providers import build_provider, registry


class DummySettings(ServiceSettings):
    dummy_depth: int = Field(default=1, ge=1, description="How deep the dummy provider digs")


class DummyPoolOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    flavour: str = Field(default="plain", pattern=r"^[a-z]+$")


class DummyProvider:
    name = "dummy"

    def __init__(self, settings: DummySettings) -> None:
        self.settings = settings


def _clear_caches() -> None:
    pool_model.cache_clear()
    pools_file_model.cache_clear()


@pytest.fixture
def dummy(monkeypatch: pytest.MonkeyPatch) -> Iterator[registry.ProviderKind]:
    kind = registry.ProviderKind(name="dummy", summary="a provider of nothing, for this test",
                                 settings=f"{__name__}:DummySettings", factory=f"{__name__}:DummyProvider",
                                 pool_options=f"{__name__}:DummyPoolOptions")
    monkeypatch.setitem(registry.PROVIDERS, "dummy", kind)
    _clear_caches()
    yield kind
    monkeypatch.undo()
    _clear_caches()


def test_a_registered_provider_is_chosen_configured_and_built(dummy: registry.ProviderKind) -> None:
    assert ControllerSettings(provider="dummy").provider == "dummy"
    built: Any = build_provider("dummy", None, dummy_depth=3)
    assert isinstance(built, DummyProvider) and built.settings.dummy_depth == 3
    with pytest.raises(ConfigurationError, match="--dummy-depth / SANDPOOL_DUMMY_DEPTH: Input should be greater"):
        build_provider("dummy", None, dummy_depth=0)


def test_its_flags_join_the_controllers(dummy: registry.ProviderKind) -> None:
    controller = build_parser("controller")
    args = controller.parse_args(["controller", "--provider", "dummy", "--dummy-depth", "4"])
    assert settings_from_args(ControllerSettings, args).provider == "dummy"
    assert settings_from_args(DummySettings, args).dummy_depth == 4


def test_its_pool_options_are_read_and_checked_with_the_pools_file(dummy: registry.ProviderKind) -> None:
    (pool,) = parse_pools({"pools": [{"name": "a", "image": "i", "flavour": "spicy"}]})
    assert pool.options["dummy"] == DummyPoolOptions(flavour="spicy")
    with pytest.raises(ConfigurationError, match=r"pools\[0\]\.flavour: String should match pattern"):
        parse_pools({"pools": [{"name": "a", "image": "i", "flavour": "Not Plain"}]})


def test_an_unregistered_provider_is_refused_by_name() -> None:
    expected = "unknown provider 'dummy' \\(expected one of local, kubernetes, simulated\\)"
    with pytest.raises(ValidationError, match=expected):
        ControllerSettings(provider="dummy")
    with pytest.raises(ConfigurationError, match="unknown provider 'dummy'"):
        build_provider("dummy")
    with pytest.raises(ConfigurationError, match=r"pools\[0\]\.flavour: Extra inputs are not permitted"):
        parse_pools({"pools": [{"name": "a", "image": "i", "flavour": "spicy"}]})
