"""Fixtures of the tests on a real single-node cluster (`.ci/cluster`).

The cluster is started outside pytest (`.ci/run` does it as root after `.ci/images`, or by hand:
`export SANDPOOL_TEST_CLUSTER_KUBECONFIG=$(.ci/cluster start)`) and named by the kubeconfig in
`SANDPOOL_TEST_CLUSTER_KUBECONFIG`. Without it every test here skips, saying why (`.ci/run` puts
the reason a start failed in `SANDPOOL_TEST_CLUSTER_UNAVAILABLE`); set but not
answering, they fail (a start that said it worked and did not is a bug to see).

When a test fails, the report gets what a cluster test needs to be read: every pod with its
phase, the recent events of the test's namespaces and the end of the controller's log.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_support import KUBECONFIG_ENV, UNAVAILABLE_ENV, Cluster
from testkit import tool

_active: list[Cluster] = []


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    path = os.environ.get(KUBECONFIG_ENV, "")
    if not path:
        why = os.environ.get(UNAVAILABLE_ENV) or f"{KUBECONFIG_ENV} is not set"
        pytest.skip(f"no real cluster: {why} (`.ci/run` starts one with `.ci/cluster start`, as root, after "
                    "`.ci/images`; DEVELOPERS.md)")
    if not Path(path).is_file():
        pytest.fail(f"{KUBECONFIG_ENV}={path} is not a file: is the cluster up? (`.ci/cluster status`)")
    found = Cluster(Path(path), tool("helm"), tool("kubectl"))
    answer = found.kubectl("get", "--raw", "/readyz", check=False)
    if answer.stdout.strip() != "ok":
        pytest.fail(f"the cluster of {path} does not answer /readyz: {answer.stderr.strip()} (`.ci/cluster status`)")
    _active.append(found)
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or not _active:
        return
    found = _active[0]
    namespaces = getattr(getattr(item, "module", None), "NAMESPACES", ())
    parts = [found.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout]
    for ns in namespaces:
        parts.append(found.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False).stdout[-4000:])
        parts.append(found.kubectl("logs", "-n", ns, "-l", "app.kubernetes.io/component=controller", "--tail=40",
                                   check=False).stdout)
    report.sections.append(("cluster state", "\n".join(parts)))
