"""Tenancy: what names a workspace, and the one workspace of standalone mode.

The workspace comes from a verified token's `workspace` claim and reaches the
session layer in process; nothing reads it from a request header.
`X-Sandpool-Workspace` is kept as the header a client might try to set, so the
tests can show it changes nothing.
"""

from __future__ import annotations

import re

WORKSPACE = "X-Sandpool-Workspace"
"""Ignored when a client sends it (the workspace is the token's)."""

WORKSPACE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

STANDALONE_WORKSPACE = "_standalone"
"""The one workspace of a standalone api (`--no-auth`: no tenancy, a single trusted client)."""


def is_valid_workspace(value: str) -> bool:
    return bool(WORKSPACE_PATTERN.fullmatch(value))
