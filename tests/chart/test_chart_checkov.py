"""checkov's Kubernetes checks over every rendered scenario: each finding is fixed or justified.

checkov runs once for the module (it is the slow part) on the manifests of the
defaults and every `charts/sandpool/ci/*.yaml`, plus a deliberately bad canary
pod that proves the scan really ran. Each remaining finding must match a row of
the justification table in docs/helm.md (check id and `Kind/name` pattern), and
each row must still match a finding, so the table never goes stale.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from typing import Any

import pytest
from chart_support import ROOT, SCENARIOS, Helm
from testkit import tool

CANARY = """\
apiVersion: v1
kind: Pod
metadata:
  name: canary
  namespace: sandpool
spec:
  containers:
    - name: canary
      image: busybox
      securityContext:
        privileged: true
"""
DOC = ROOT / "docs" / "helm.md"


@pytest.fixture(scope="module")
def checkov_findings(helm: Helm, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, str]]:
    checkov = tool("checkov")
    out = tmp_path_factory.mktemp("rendered")
    for scenario in (None, *SCENARIOS):
        name = scenario or "defaults.yaml"
        (out / name).write_text(helm.template_text(*(() if scenario is None else (scenario,))))
    (out / "zz-canary.yaml").write_text(CANARY)
    scan = subprocess.run([checkov, "-d", str(out), "--framework", "kubernetes", "--output", "json", "--quiet",
                           "--compact", "--skip-download"], capture_output=True, text=True, timeout=240)
    assert scan.returncode in (0, 1), f"checkov crashed:\n{scan.stderr[-3000:]}"
    reports: Any = json.loads(scan.stdout)
    if isinstance(reports, dict):
        reports = [reports]
    findings = []
    for report in reports:
        for failed in report["results"]["failed_checks"]:
            kind, _namespace, name = failed["resource"].split(".", 2)
            findings.append((failed["check_id"], f"{kind}/{name}", failed["file_path"]))
    return findings


def justifications() -> list[tuple[str, list[str]]]:
    """(check id, [Kind/name patterns]) rows of the table under docs/helm.md's checkov section."""
    text = DOC.read_text()
    section = text[text.index("## Security scan"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    rows = []
    for line in section.splitlines():
        match = re.match(r"^\|\s*`?(CKV2?_K8S_\d+)`?\s*\|([^|]+)\|", line)
        if match:
            patterns = [p.strip().strip("`") for p in match.group(2).split(",") if p.strip()]
            rows.append((match.group(1), patterns))
    return rows


def test_the_scan_ran_and_caught_the_canary(checkov_findings: list[tuple[str, str, str]]) -> None:
    canary = {check for check, resource, _ in checkov_findings if resource == "Pod/canary"}
    assert "CKV_K8S_16" in canary, f"checkov did not flag a privileged container: {sorted(canary)}"


def test_every_finding_is_justified_in_the_docs(checkov_findings: list[tuple[str, str, str]]) -> None:
    rows = justifications()
    assert rows, "docs/helm.md has no justification table"
    unjustified = sorted({(check, resource) for check, resource, _ in checkov_findings
                          if resource != "Pod/canary"
                          and not any(check == rid and any(fnmatch.fnmatch(resource, p) for p in pats)
                                      for rid, pats in rows)})
    assert not unjustified, f"fix these or justify them in docs/helm.md: {unjustified}"


def test_no_stale_justification(checkov_findings: list[tuple[str, str, str]]) -> None:
    real = {(check, resource) for check, resource, _ in checkov_findings if resource != "Pod/canary"}
    for rid, patterns in justifications():
        for pattern in patterns:
            assert any(check == rid and fnmatch.fnmatch(resource, pattern) for check, resource in real), \
                f"docs/helm.md justifies {rid} on {pattern}, but checkov no longer reports it: drop the row"
