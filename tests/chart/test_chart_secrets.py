"""Generated credentials are generated once and kept across upgrades.

`helm template --dry-run=server` runs the chart's `lookup` calls against a
fake API server on loopback that holds the Secrets of a first render (the
"install"): the second render (the "upgrade") must reuse every generated
value, so the pods' checksum annotations do not change either.
"""

from __future__ import annotations

import os
from pathlib import Path

from chart_support import FakeApiServer, Helm, find, parse, secret_value
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key

GENERATED = [("-signing", "ed25519.key"), ("-redis", "password"), ("-redis", "auth.conf"), ("-redis-url", "url")]


def _upgrade(helm: Helm, fake_api: FakeApiServer, tmp_path: Path, *sets: str) -> list[dict]:
    env = {**os.environ, "KUBECONFIG": str(fake_api.kubeconfig(tmp_path)), "HELM_CACHE_HOME": str(tmp_path / "cache"),
           "HELM_CONFIG_HOME": str(tmp_path / "config")}
    return parse(helm.template_text(sets=sets, extra=("--dry-run=server",), env=env))


def test_generated_secrets_are_strong_and_fresh_per_install(helm: Helm) -> None:
    first, second = helm.render(), parse(helm.template_text())
    for suffix, key in GENERATED:
        a, b = secret_value(find(first, "Secret", suffix), key), secret_value(find(second, "Secret", suffix), key)
        assert a != b, f"{suffix}/{key} is not random"
    assert len(secret_value(find(first, "Secret", "-redis"), "password")) == 32
    # No credential between two services: the api holds the edge and the session layer in one process.
    assert {o["metadata"]["name"] for o in first if o["kind"] == "Secret"} == {
        "sp-sandpool-auth", "sp-sandpool-signing", "sp-sandpool-redis", "sp-sandpool-redis-url"}
    key = load_pem_private_key(secret_value(find(first, "Secret", "-signing"), "ed25519.key").encode(), None)
    assert isinstance(key, Ed25519PrivateKey)
    assert find(first, "Secret", "-signing")["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_upgrade_keeps_every_generated_secret(helm: Helm, fake_api: FakeApiServer, tmp_path: Path) -> None:
    installed = parse(helm.template_text())
    fake_api.hold(installed)
    upgraded = _upgrade(helm, fake_api, tmp_path)
    for suffix, key in GENERATED:
        assert secret_value(find(upgraded, "Secret", suffix), key) == \
            secret_value(find(installed, "Secret", suffix), key), f"{suffix}/{key} was regenerated on upgrade"
    assert any(r.startswith("/api/v1/namespaces/sandpool/secrets/sp-sandpool-signing") for r in fake_api.requests)
    assert any(r.startswith("/api/v1/namespaces/sandpool/secrets/sp-sandpool-redis") for r in fake_api.requests)
    # Same secrets, same checksums: an upgrade that changes nothing rolls nothing.
    for kind, suffix in (("Deployment", "-api"), ("Deployment", "-controller"), ("StatefulSet", "-redis")):
        before = find(installed, kind, suffix)["spec"]["template"]["metadata"]["annotations"]
        after = find(upgraded, kind, suffix)["spec"]["template"]["metadata"]["annotations"]
        assert before == after, f"{kind}{suffix} would roll on a no-op upgrade"


def test_explicit_values_win_over_the_live_secret(helm: Helm, fake_api: FakeApiServer, tmp_path: Path) -> None:
    """Rotation is explicit: a value given at upgrade replaces the kept one (and rolls the pods)."""
    installed = parse(helm.template_text())
    fake_api.hold(installed)
    new_key = Ed25519PrivateKey.generate()
    from cryptography.hazmat.primitives import serialization as s
    pem = new_key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()).decode()
    key_file = tmp_path / "key-values.yaml"
    import yaml
    key_file.write_text(yaml.safe_dump({"auth": {"privateKey": pem}}))
    upgraded = _upgrade(helm, fake_api, tmp_path, f"redis.bundled.password={'q' * 20}")
    assert secret_value(find(upgraded, "Secret", "-redis"), "password") == "q" * 20
    assert (secret_value(find(upgraded, "Secret", "-redis-url"), "url")
            == "redis://:" + "q" * 20 + "@sp-sandpool-redis:6379/0")
    for suffix in ("-api", "-controller"):  # both read Redis: a new password rolls both
        before = find(installed, "Deployment", suffix)["spec"]["template"]["metadata"]["annotations"]
        after = find(upgraded, "Deployment", suffix)["spec"]["template"]["metadata"]["annotations"]
        assert before["checksum/secrets"] != after["checksum/secrets"], suffix
    redis_before = find(installed, "StatefulSet", "-redis")["spec"]["template"]["metadata"]["annotations"]
    redis_after = find(upgraded, "StatefulSet", "-redis")["spec"]["template"]["metadata"]["annotations"]
    assert redis_before["checksum/auth"] != redis_after["checksum/auth"], "Redis must restart with its new password"
    assert redis_before["checksum/config"] == redis_after["checksum/config"]
    env = {**os.environ, "KUBECONFIG": str(fake_api.kubeconfig(tmp_path)), "HELM_CACHE_HOME": str(tmp_path / "cache"),
           "HELM_CONFIG_HOME": str(tmp_path / "config")}
    rotated = parse(helm.template_text(str(key_file), extra=("--dry-run=server",), env=env))
    assert secret_value(find(rotated, "Secret", "-signing"), "ed25519.key") == pem


def test_existing_secrets_are_referenced_not_created(helm: Helm) -> None:
    objs = helm.render("external-redis-values.yaml", sets=(
        "auth.existingSecret=my-keys",
        "auth.existingSecretKeyNames={ops-a,ops-b}", "auth.generateSigningKey=false"))
    names = {o["metadata"]["name"] for o in objs if o["kind"] == "Secret"}
    assert names == set(), f"no Secret should be created, got {names}"
    api = find(objs, "Deployment", "-api")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in api["volumes"]}
    assert volumes["keys"]["secret"]["secretName"] == "my-keys"
    # Only the named public keys are mounted, whatever else the operator's Secret holds.
    assert volumes["keys"]["secret"]["items"] == [{"key": "ops-a.pub", "path": "ops-a.pub"},
                                                  {"key": "ops-b.pub", "path": "ops-b.pub"}]
    args = api["containers"][0]["args"]
    assert "--auth-public-key=/etc/sandpool/keys/ops-a.pub" in args
    assert "--auth-public-key=/etc/sandpool/keys/ops-b.pub" in args
    for suffix in ("-api", "-controller"):
        container = find(objs, "Deployment", suffix)["spec"]["template"]["spec"]["containers"][0]
        [redis_env] = [e for e in container["env"] if e["name"] == "SANDPOOL_REDIS_URL"]
        assert redis_env["valueFrom"]["secretKeyRef"] == {"name": "sandpool-redis", "key": "url"}, suffix
