"""Structured (JSON) logs on stderr with stable keys.

A request id set by the HTTP edge (`request_id_var`) is added to every line
logged while that request is being served. Credentials in URLs are blanked in
every part of a line (message, fields, traceback): see `core/redact.py`.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

from sandpool.core.redact import redact

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        rid = request_id_var.get()
        if rid:
            line["request_id"] = rid
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                line[key] = redact(value)
        if record.exc_info:
            line["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, default=lambda value: redact(str(value)))


def configure_logging(service: str, level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    _set_level(root, level.upper())
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        _set_level(logging.getLogger(noisy), logging.WARNING)


def _set_level(logger: logging.Logger, level: str | int) -> None:
    """`logger.setLevel(level)` unless it is already that level: each call walks every logger to clear
    its cache, and in an agent forked from the zygote (which set the same levels) that walk only
    copies pages."""
    numeric = logging.getLevelNamesMapping().get(level) if isinstance(level, str) else level
    if numeric is None or logger.level != numeric:
        logger.setLevel(level)
