"""`--redis-url` in each of its forms: what each names, and a clear refusal naming the form for a
malformed one, at settings time (before anything starts) and from `sandpool api` itself."""

from __future__ import annotations

import subprocess
import sys

import pytest
from testkit import scrubbed_env

from sandpool.api.settings import ApiSettings
from sandpool.core.settings import ConfigurationError
from sandpool.state.client import parse


def test_each_form_names_its_nodes_service_and_credentials() -> None:
    assert parse("redis://:pw@127.0.0.1:6379/2").kind == "server"
    assert parse("rediss://h:6380/0").kind == "server"
    assert parse("unix:///run/redis.sock").kind == "server"
    sentinel = parse("redis+sentinel://:s%40cret@a:26379,b:26380,[::1]:26381/mymaster/3")
    assert (sentinel.kind, sentinel.nodes, sentinel.service, sentinel.db, sentinel.password) == (
        "sentinel", (("a", 26379), ("b", 26380), ("::1", 26381)), "mymaster", 3, "s@cret")
    assert parse("redis+sentinel://a:26379/mymaster").db == 0
    cluster = parse("redis+cluster://user:pw@a:7000,b:7001")
    assert (cluster.kind, cluster.nodes, cluster.username, cluster.password) == (
        "cluster", (("a", 7000), ("b", 7001)), "user", "pw")


@pytest.mark.parametrize(("url", "form"), [
    ("redis+sentinel://a:26379", "redis+sentinel://host:port[,host:port...]/service_name[/db]"),
    ("redis+sentinel://a:26379/svc/zero", "redis+sentinel://"),
    ("redis+sentinel://:pw@a/svc", "redis+sentinel://"),
    ("redis+sentinel://a:26379,b:x/svc", "redis+sentinel://"),
    ("redis+cluster://a:7000/0", "redis+cluster://host:port[,host:port...]"),
    ("redis+cluster://a:7000?timeout=1", "redis+cluster://"),
    ("redis+cluster://", "redis+cluster://"),
    ("sentinel://a:26379/svc", "redis+sentinel://"),
    ("127.0.0.1:6379", "redis+cluster://"),
])
def test_a_malformed_url_is_refused_naming_the_form(url: str, form: str) -> None:
    with pytest.raises(ConfigurationError, match="--redis-url") as refused:
        ApiSettings(auth=False, redis_url=url)
    assert form in str(refused.value)


def test_a_refusal_never_shows_the_password() -> None:
    with pytest.raises(ConfigurationError) as refused:
        parse("redis+sentinel://:hunter2@a:26379")
    assert "hunter2" not in str(refused.value)


def test_sandpool_api_with_a_malformed_url_says_why_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "sandpool", "api", "--no-auth"], capture_output=True, text=True,
                          timeout=60, env=scrubbed_env(SANDPOOL_REDIS_URL="redis+cluster://:hunter2@a:7000/svc"))
    assert done.returncode != 0
    assert "expected redis+cluster://host:port[,host:port...] (with a password: :password@" in done.stderr, done.stderr
    assert "hunter2" not in done.stderr and "Traceback" not in done.stderr, done.stderr
