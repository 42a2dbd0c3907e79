"""Provider settings: every field a --kube-* flag and SANDPOOL_KUBE_* variable; bad values name the flag."""

from __future__ import annotations

import argparse

import pytest

from sandpool.core.settings import ConfigurationError, add_settings_arguments, settings_from_args
from sandpool.providers import build_provider
from sandpool.providers.kubernetes import KubernetesProvider, KubernetesProviderSettings


def parse(argv: list[str]) -> KubernetesProviderSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, KubernetesProviderSettings)
    return settings_from_args(KubernetesProviderSettings, parser.parse_args(argv))


def test_flags_environment_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDPOOL_KUBE_NAMESPACE", "from-env")
    monkeypatch.setenv("SANDPOOL_KUBE_CREATE_RATE", "3.5")
    settings = parse(["--kubeconfig", "/k/config", "--kube-installation", "prod", "--kube-create-rate", "7"])
    assert str(settings.kubeconfig) == "/k/config"
    assert settings.kube_namespace == "from-env"
    assert settings.kube_installation == "prod"
    assert settings.kube_create_rate == 7  # the flag wins over the environment
    assert settings.kube_agent_port == 8080 and settings.kube_tmp_size == "64Mi"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--kube-namespace", "Not_A_Namespace"], "--kube-namespace / SANDPOOL_KUBE_NAMESPACE"),
        (["--kube-installation", "x" * 21], "--kube-installation / SANDPOOL_KUBE_INSTALLATION"),
        (["--kube-tmp-size", "lots"], "--kube-tmp-size / SANDPOOL_KUBE_TMP_SIZE"),
        (["--kube-create-rate", "0"], "--kube-create-rate / SANDPOOL_KUBE_CREATE_RATE"),
        (["--kube-agent-port", "70000"], "--kube-agent-port / SANDPOOL_KUBE_AGENT_PORT"),
        (["--kube-image-pull-policy", "Sometimes"], "--kube-image-pull-policy / SANDPOOL_KUBE_IMAGE_PULL_POLICY"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        parse(argv)


def test_the_provider_factory_builds_it_lazily_from_any_settings_object() -> None:
    class Other:
        kube_namespace = "elsewhere"
        unrelated = "ignored"

    provider = build_provider("kubernetes", Other(), kube_installation="two")
    assert isinstance(provider, KubernetesProvider)
    assert (provider.settings.kube_namespace, provider.settings.kube_installation) == ("elsewhere", "two")
    assert provider.describe()["namespace"] == "elsewhere"
    with pytest.raises(ConfigurationError, match="--kube-namespace"):
        build_provider("kubernetes", None, kube_namespace="BAD")
