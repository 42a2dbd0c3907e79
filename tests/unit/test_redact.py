"""Credentials in URLs are blanked wherever settings, messages or errors are printed."""

from __future__ import annotations

import json
import logging

import pytest

from sandpool.core.logs import JsonFormatter
from sandpool.core.redact import redact
from sandpool.core.settings import ServiceSettings, dump_settings, secret_field


@pytest.mark.parametrize(("text", "shown"), [
    ("redis://:s3cret@10.0.0.1:6379/0", "redis://***@10.0.0.1:6379/0"),
    ("rediss://user:s3cret@redis.example:6380", "rediss://***@redis.example:6380"),
    ("https://token@jwks.example/keys.json", "https://***@jwks.example/keys.json"),
    ("redis://:p@ss@host/0", "redis://***@host/0"),  # an unescaped '@' in the password
    ("failed: redis://:a@h1/0 and redis://:b@h2/0", "failed: redis://***@h1/0 and redis://***@h2/0"),
    ("http://host:8080/path?x=a@b", "http://host:8080/path?x=a@b"),  # no userinfo: untouched
    ("unix:///run/agent.sock", "unix:///run/agent.sock"),
    ("mail me at a@b.example", "mail me at a@b.example"),
])
def test_userinfo_is_blanked(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_containers_are_walked_and_other_values_kept() -> None:
    value = {"urls": ["redis://:x@h/0", ("http://u:y@h",)], "port": 6379, "none": None}
    assert redact(value) == {"urls": ["redis://***@h/0", ("http://***@h",)], "port": 6379, "none": None}


def test_settings_dump_and_log_lines_carry_no_credential() -> None:
    class Settings(ServiceSettings):
        redis_url: str = "redis://:hunter2@127.0.0.1:6379/0"
        token: str | None = secret_field("a secret")

    dumped = json.loads(dump_settings(Settings(token="t0ken")))
    assert dumped == {"redis_url": "redis://***@127.0.0.1:6379/0", "token": "***"}

    class Error(Exception):
        pass

    error = Error("cannot reach redis://:hunter2@h/0")
    try:
        raise error
    except Error:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed at %s", ("https://a:hunter2@h",),
                                   (Error, error, error.__traceback__))
    record.error = error  # a non-string field, printed with str()
    record.where = {"url": "redis://:hunter2@h/0"}
    line = JsonFormatter("test").format(record)
    assert "hunter2" not in line
    assert json.loads(line)["msg"] == "failed at https://***@h"
