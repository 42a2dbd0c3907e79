"""Names of the usage counters (hash fields of the usage keys and stream event fields)."""

from __future__ import annotations

SESSIONS_CREATED = "sessions_created"
SESSION_SECONDS = "session_seconds"
BYTES_UPLOADED = "bytes_uploaded"
BYTES_DOWNLOADED = "bytes_downloaded"
CAPACITY_REFUSALS = "capacity_refusals"
QUOTA_REFUSALS = "quota_refusals"


def executions(tool: str) -> str:
    return f"executions:{tool}"


def execution_seconds(tool: str) -> str:
    return f"execution_seconds:{tool}"
