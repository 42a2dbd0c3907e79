"""`sandpool keygen` and `sandpool token`: a signing key pair, and tokens signed with it.

`generate_keypair` and `mint_token` are plain functions so `sandpool up` can
create a dev key under its data directory and print a ready token. The private
key is written 0600 and never overwritten unless asked; tokens carry the key's
RFC 7638 thumbprint as `kid`, which is what the api looks keys up by.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from sandpool.contract.tenancy import is_valid_workspace
from sandpool.edge.keys import algorithm_for, thumbprint

DEFAULT_KEY_PATH = Path("~/.config/sandpool/auth-key.pem")
DEFAULT_TTL_SECONDS = 3600
MAX_TTL_SECONDS = 366 * 86400


def public_key_path(private_key_path: str | Path) -> Path:
    path = Path(private_key_path)
    return path.with_name(path.name + ".pub")


def _write(path: Path, data: bytes, mode: int, *, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT's mode does not apply to a file that existed (--force)
        os.write(fd, data)
    finally:
        os.close(fd)


def generate_keypair(path: str | Path, *, force: bool = False) -> tuple[Path, Path]:
    """Write an Ed25519 private key (PEM, 0600) at `path` and its public key at `path.pub`.

    Returns (private, public). Raises FileExistsError when either exists and
    `force` is false: replacing a signing key silently would lock out every
    token minted with it.
    """
    private_path = Path(path).expanduser()
    public_path = public_key_path(private_path)
    if not force:
        for existing in (private_path, public_path):
            if existing.exists():
                raise FileExistsError(f"{existing} exists (use --force to replace it)")
    private_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    _write(private_path, private_pem, 0o600, force=force)
    _write(public_path, public_pem, 0o644, force=force)
    return private_path, public_path


def load_private_key(path: str | Path) -> Any:
    data = Path(path).expanduser().read_bytes()
    return serialization.load_pem_private_key(data, password=None)


def mint_token(private_key_path: str | Path, workspace: str, *, admin: bool = False,
               ttl_seconds: int = DEFAULT_TTL_SECONDS, audience: str = "sandpool", kid: str | None = None,
               subject: str | None = None, scopes: list[str] | None = None, jti: str | None = None,
               now: float | None = None) -> str:
    """A signed token for `workspace` (EdDSA for an Ed25519 key; RS256/ES256 for RSA/P-256 keys).

    Claims: workspace, aud, sub, iat, nbf, exp, jti, and scope (`admin` when
    `admin`). `kid` defaults to the public key's thumbprint, which is the kid
    the api gives a key loaded from a PEM file.
    """
    if not is_valid_workspace(workspace):
        raise ValueError(f"invalid workspace name {workspace!r}")
    if not 1 <= ttl_seconds <= MAX_TTL_SECONDS:
        raise ValueError(f"ttl must be between 1 and {MAX_TTL_SECONDS} seconds")
    key = load_private_key(private_key_path)
    algorithm = algorithm_for(key)
    issued = int(time.time() if now is None else now)
    scope = list(scopes or [])
    if admin and "admin" not in scope:
        scope.append("admin")
    claims: dict[str, Any] = {"workspace": workspace, "aud": audience, "sub": subject or f"workspace:{workspace}",
                              "iat": issued, "nbf": issued, "exp": issued + ttl_seconds,
                              "jti": jti or uuid.uuid4().hex}
    if scope:
        claims["scope"] = " ".join(scope)
    headers = {"kid": kid or thumbprint(key.public_key())}
    return jwt.encode(claims, key, algorithm=algorithm, headers=headers)


def register(subparsers: Any) -> None:
    keygen = subparsers.add_parser("keygen", help="write an Ed25519 signing key pair for tokens",
                                   description="Write an Ed25519 private key (0600) and its public key (PATH.pub).")
    keygen.add_argument("--out", default=str(DEFAULT_KEY_PATH),
                        help=f"private key path; the public key goes to PATH.pub [default: {DEFAULT_KEY_PATH}]")
    keygen.add_argument("--force", action="store_true", help="replace existing files")
    keygen.set_defaults(func=run_keygen)

    token = subparsers.add_parser("token", help="print a signed token for a workspace",
                                  description="Print a signed JWT for the api (EdDSA with an Ed25519 key).")
    token.add_argument("--workspace", required=True, help="the token's workspace")
    token.add_argument("--admin", action="store_true", help="add the admin scope (the whole admin API)")
    token.add_argument("--ttl", type=int, default=DEFAULT_TTL_SECONDS,
                       help=f"lifetime in seconds [default: {DEFAULT_TTL_SECONDS}]")
    token.add_argument("--key", default=str(DEFAULT_KEY_PATH),
                       help=f"private key PEM [default: {DEFAULT_KEY_PATH}]")
    token.add_argument("--kid", default=None, help="key id header [default: the key's RFC 7638 thumbprint]")
    token.add_argument("--audience", default="sandpool", help="aud claim [default: sandpool]")
    token.add_argument("--subject", default=None, help="sub claim [default: workspace:<workspace>]")
    token.set_defaults(func=run_token)


def run_keygen(args: argparse.Namespace) -> int:
    try:
        private_path, public_path = generate_keypair(args.out, force=args.force)
    except FileExistsError as exc:
        print(f"sandpool keygen: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sandpool keygen: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"private key: {private_path}")
    print(f"public key: {public_path}")
    return 0


def run_token(args: argparse.Namespace) -> int:
    try:
        token = mint_token(args.key, args.workspace, admin=args.admin, ttl_seconds=args.ttl,
                           audience=args.audience, kid=args.kid, subject=args.subject)
    except FileNotFoundError:
        print(f"sandpool token: no private key at {args.key} (run `sandpool keygen --out {args.key}`)",
              file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError) as exc:
        print(f"sandpool token: {exc}", file=sys.stderr)
        return 1
    claims = jwt.decode(token, options={"verify_signature": False})
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(claims["exp"]))
    # The token alone on stdout (pipe-friendly); what an operator needs to revoke it, on stderr.
    print(f"jti={claims['jti']} expires={expires} workspace={claims['workspace']}"
          + (f" scope={claims['scope']}" if claims.get("scope") else ""), file=sys.stderr)
    print(token)
    return 0
