"""The internal interface between the proxy and a multi-tenant scheduler.

The proxy strips every inbound header starting with `X-Sandpool-` and injects
the workspace (from a verified token) and one header per limit the scheduler
enforces (named in `contract/limits.py`); the scheduler trusts them only when
the request also carries the internal credential.
"""

from __future__ import annotations

import re

HEADER_PREFIX = "x-sandpool-"

WORKSPACE = "X-Sandpool-Workspace"
REQUEST_ID = "X-Request-Id"

WORKSPACE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

STANDALONE_WORKSPACE = "_standalone"
"""The one workspace of a standalone scheduler (no tenancy, a single trusted client)."""


def is_valid_workspace(value: str) -> bool:
    return bool(WORKSPACE_PATTERN.fullmatch(value))
