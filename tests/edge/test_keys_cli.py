"""`sandpool keygen` / `sandpool token` and the functions `sandpool up` calls."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from sandpool.edge.keys import load_pem_public_key, thumbprint
from sandpool.edge.keys_cli import generate_keypair, mint_token


def sandpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandpool", *args], capture_output=True, text=True, timeout=60)


def test_generate_keypair_writes_private_0600_and_public_pub(tmp_path: Path) -> None:
    private, public = generate_keypair(tmp_path / "d" / "k.pem")
    assert public == tmp_path / "d" / "k.pem.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in private.read_bytes() and b"PUBLIC KEY" in public.read_bytes()
    assert load_pem_public_key(public).algorithm == "EdDSA"


def test_generate_keypair_never_overwrites_without_force(tmp_path: Path) -> None:
    private, public = generate_keypair(tmp_path / "k.pem")
    before = private.read_bytes()
    with pytest.raises(FileExistsError):
        generate_keypair(tmp_path / "k.pem")
    assert private.read_bytes() == before
    public.unlink()
    with pytest.raises(FileExistsError):  # the private key alone is enough to refuse
        generate_keypair(tmp_path / "k.pem")
    private.chmod(0o644)
    generate_keypair(tmp_path / "k.pem", force=True)
    assert private.read_bytes() != before and stat.S_IMODE(private.stat().st_mode) == 0o600


def test_mint_token_claims_and_kid(tmp_path: Path) -> None:
    private, public = generate_keypair(tmp_path / "k.pem")
    trusted = load_pem_public_key(public)
    token = mint_token(private, "acme", admin=True, ttl_seconds=120)
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "EdDSA" and header["kid"] == trusted.kid
    claims = jwt.decode(token, trusted.key, algorithms=["EdDSA"], audience="sandpool")
    assert claims["workspace"] == "acme" and claims["scope"] == "admin" and claims["jti"]
    assert claims["exp"] - claims["iat"] == 120 and claims["exp"] - time.time() <= 121
    plain = jwt.decode(mint_token(private, "acme", audience="x", kid="k1"), trusted.key, algorithms=["EdDSA"],
                       audience="x")
    assert "scope" not in plain
    assert jwt.get_unverified_header(mint_token(private, "acme", kid="k1"))["kid"] == "k1"
    with pytest.raises(ValueError):
        mint_token(private, "../bad")
    with pytest.raises(ValueError):
        mint_token(private, "acme", ttl_seconds=0)


def test_thumbprint_matches_rfc7638_example() -> None:
    # RFC 8037 appendix A.3: the thumbprint of its Ed25519 example key.
    pem = serialization.load_der_public_key(bytes.fromhex(
        "302a300506032b6570032100d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"))
    assert thumbprint(pem) == "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"  # type: ignore[arg-type]  # an Ed25519 key, of the types thumbprint takes


def test_commands(tmp_path: Path) -> None:
    out = tmp_path / "cli" / "key.pem"
    made = sandpool("keygen", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert str(out) in made.stdout and f"{out}.pub" in made.stdout
    again = sandpool("keygen", "--out", str(out))
    assert again.returncode == 1 and "--force" in again.stderr
    token = sandpool("token", "--workspace", "acme", "--admin", "--ttl", "60", "--key", str(out))
    assert token.returncode == 0, token.stderr
    claims = jwt.decode(token.stdout.strip(), load_pem_public_key(f"{out}.pub").key, algorithms=["EdDSA"],
                        audience="sandpool")
    assert claims["workspace"] == "acme" and claims["scope"] == "admin"
    missing = sandpool("token", "--workspace", "acme", "--key", str(tmp_path / "none.pem"))
    assert missing.returncode == 1 and "keygen" in missing.stderr
    bad = sandpool("token", "--workspace", "no/slash", "--key", str(out))
    assert bad.returncode == 1 and "workspace" in bad.stderr
