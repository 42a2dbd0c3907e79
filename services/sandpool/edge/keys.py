"""Trusted public keys: loaded from PEM files or a JWKS document, identified by `kid`.

Only asymmetric *public* keys ever enter a key ring, each tagged with the one
algorithm it verifies. That is what makes the classic confusions impossible: a
token whose header says HS256 finds no key for HS256 (so signing with the
public key as an HMAC secret gets nowhere), and a `kty: oct` or private JWK is
dropped at load.

A PEM key's `kid` is its RFC 7638 thumbprint, which `sandpool token` puts in
every token it mints, so rotating keys needs no naming scheme: trust the new
key next to the old one, mint with the new one, drop the old one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from sandpool.core.settings import ConfigurationError

log = logging.getLogger(__name__)

PublicKey = ed25519.Ed25519PublicKey | rsa.RSAPublicKey | ec.EllipticCurvePublicKey

MIN_RSA_BITS = 2048


@dataclass(frozen=True)
class TrustedKey:
    kid: str
    algorithm: str  # the one algorithm this key verifies: EdDSA, RS256 or ES256
    key: PublicKey
    source: str  # where it came from, for logs (a path or "jwks")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _int_b64(value: int) -> str:
    return _b64(value.to_bytes((value.bit_length() + 7) // 8 or 1, "big"))


def algorithm_for(key: Any) -> str:
    """The algorithm a public (or private) key is used with; ValueError for anything else."""
    if isinstance(key, (ed25519.Ed25519PublicKey, ed25519.Ed25519PrivateKey)):
        return "EdDSA"
    if isinstance(key, (rsa.RSAPublicKey, rsa.RSAPrivateKey)):
        if key.key_size < MIN_RSA_BITS:
            raise ValueError(f"RSA keys must have at least {MIN_RSA_BITS} bits")
        return "RS256"
    if isinstance(key, (ec.EllipticCurvePublicKey, ec.EllipticCurvePrivateKey)):
        if not isinstance(key.curve, ec.SECP256R1):
            raise ValueError("EC keys must be on P-256 (ES256)")
        return "ES256"
    raise ValueError(f"unsupported key type {type(key).__name__}: use Ed25519, RSA or EC P-256")


def thumbprint(key: PublicKey) -> str:
    """RFC 7638 JWK thumbprint (SHA-256, base64url): the key's default `kid`."""
    if isinstance(key, ed25519.Ed25519PublicKey):
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        members = {"crv": "Ed25519", "kty": "OKP", "x": _b64(raw)}
    elif isinstance(key, rsa.RSAPublicKey):
        rsa_numbers = key.public_numbers()
        members = {"e": _int_b64(rsa_numbers.e), "kty": "RSA", "n": _int_b64(rsa_numbers.n)}
    elif isinstance(key, ec.EllipticCurvePublicKey):
        ec_numbers = key.public_numbers()
        size = (key.curve.key_size + 7) // 8
        members = {"crv": "P-256", "kty": "EC", "x": _b64(ec_numbers.x.to_bytes(size, "big")),
                   "y": _b64(ec_numbers.y.to_bytes(size, "big"))}
    else:
        raise ValueError(f"unsupported key type {type(key).__name__}")
    canonical = json.dumps(members, separators=(",", ":"), sort_keys=True).encode()
    return _b64(hashlib.sha256(canonical).digest())


def load_pem_public_key(path: str | Path) -> TrustedKey:
    """A trusted key from a PEM file; a private key or an unsupported type is a configuration error."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"--auth-public-key {path}: cannot read ({exc.strerror})") from None
    if b"PRIVATE KEY" in data:
        raise ConfigurationError(f"--auth-public-key {path}: holds a private key; give the public key (.pub)")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise ConfigurationError(f"--auth-public-key {path}: not a PEM public key") from None
    try:
        algorithm = algorithm_for(key)
    except ValueError as exc:
        raise ConfigurationError(f"--auth-public-key {path}: not a usable public key ({exc})") from None
    # algorithm_for refused every key type TrustedKey does not hold
    return TrustedKey(kid=thumbprint(key), algorithm=algorithm, key=key,  # type: ignore[arg-type]  # see above
                      source=str(path))


def parse_jwks(document: Any, *, source: str = "jwks") -> list[TrustedKey]:
    """Usable public keys of a JWKS document; symmetric, private and unsupported members are skipped.

    A member without `kid` gets its thumbprint as kid. Raises ValueError when
    the document is not a JWKS at all.
    """
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError("not a JWKS document (expected an object with a `keys` list)")
    found: list[TrustedKey] = []
    for index, member in enumerate(document["keys"]):
        if not isinstance(member, dict):
            continue
        where = f"{source} key #{index}"
        if member.get("kty") == "oct" or str(member.get("alg", "")).upper().startswith("HS"):
            log.warning("ignoring symmetric key in JWKS", extra={"key": where})
            continue
        if "d" in member:
            log.warning("ignoring private key material in JWKS (publish public keys only)", extra={"key": where})
            continue
        if member.get("use") not in (None, "sig"):
            continue
        try:
            key = jwt.PyJWK(member).key
            algorithm = algorithm_for(key)
        except (jwt.PyJWTError, ValueError, TypeError) as exc:
            log.warning("ignoring unusable JWKS key", extra={"key": where, "error": str(exc)})
            continue
        if not isinstance(key, (ed25519.Ed25519PublicKey, rsa.RSAPublicKey, ec.EllipticCurvePublicKey)):
            continue
        declared = member.get("alg")
        if declared is not None and declared != algorithm:
            log.warning("ignoring JWKS key whose alg does not match its type", extra={"key": where})
            continue
        kid = member.get("kid")
        found.append(TrustedKey(kid=kid if isinstance(kid, str) and kid else thumbprint(key),
                                algorithm=algorithm, key=key, source=source))
    return found
