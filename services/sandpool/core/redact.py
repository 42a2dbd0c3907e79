"""Credentials out of everything printed: the userinfo of URLs (`redis://:password@host`).

Settings dumps and log lines carry URLs (Redis, a JWKS document, a
cluster) and errors may quote them; their userinfo is a credential however the
field is marked. `redact` blanks it in a string, or in every string of a list,
tuple or dict, and leaves everything else as it is.
"""

from __future__ import annotations

import re
from typing import Any

# scheme://userinfo@ : the userinfo runs to the last '@' before the path, query or fragment (or a
# space or a quote, which a URL never holds raw), so a password with an unescaped '@' is covered too.
URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s\"<>]*@")
REDACTED = "***"


def redact(value: Any) -> Any:
    if isinstance(value, str):
        return URL_USERINFO.sub(rf"\g<1>{REDACTED}@", value) if "://" in value else value
    if isinstance(value, dict):
        return {key: redact(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(item) for item in value)
    return value
