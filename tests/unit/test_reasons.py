"""Error reasons and the agent protocol are declared once (`contract/`); the services, the client and
docs/api.md say the same.

- every `reason` a `SandpoolError` subclass declares is a catalogue member, with the catalogue's status;
- no reason is spelled as a bare string where a reason goes (a class's `reason`/`default_reason`, an
  error body's `"reason"` key, a `reason=` argument, a comparison with a `.reason`), and every
  catalogue entry is used somewhere;
- docs/api.md's "Reasons" table is the catalogue, and each status/reason pair it mentions elsewhere
  agrees with it;
- the client maps every reason to an exception of its status's kind;
- the outcome labels the agent produces are the catalogue's and the api's metric labels.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandpool
from sandpool.client.errors import SandpoolClientError, Unavailable, error_class_for, error_from_response
from sandpool.contract.agent_protocol import Outcome
from sandpool.contract.reasons import CATALOGUE, ClientReason, Reason
from sandpool.core.errors import SandpoolError
from sandpool.edge.auth import REASONS as CREDENTIAL_CAUSES
from sandpool.sessions.metrics import EXEC_OUTCOMES

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "services" / "sandpool"
API_DOC = ROOT / "docs" / "api.md"
ENUMS = {"Reason": {r.value for r in Reason}, "ClientReason": {r.value for r in ClientReason}}
REASON_NAMES = ("reason", "default_reason")
SCANNED = ("agent", "api", "client", "contract", "core", "edge", "sessions")
"""The packages that answer or read error bodies. The others' `reason`s are other words: the egress
proxy's `X-Sandpool-Egress-Refusal` (docs/egress.md), a lost pod's, a session the controller reaped."""


RETIRED = frozenset({"TENANCY_MISSING", "TENANCY_INVALID", "SCHEDULER_UNAVAILABLE"})
"""Reasons of the proxy -> scheduler hop, which is gone: still catalogued (docs/api.md lists them as
retired; a client still maps them) and answered by nothing."""


def all_subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from all_subclasses(sub)


@pytest.fixture(scope="module")
def service_errors() -> list[type[SandpoolError]]:
    """Every SandpoolError subclass any sandpool module declares (all of them imported)."""
    for module in pkgutil.walk_packages(sandpool.__path__, "sandpool."):
        if not module.name.endswith(".__main__"):
            importlib.import_module(module.name)
    return list(all_subclasses(SandpoolError))


def test_every_declared_reason_is_catalogued_with_its_status(service_errors: list[type[SandpoolError]]) -> None:
    assert len(service_errors) > 20  # the walk found the services' errors, not only core's
    wrong = []
    for cls in [SandpoolError, *service_errors]:
        where = f"{cls.__module__}.{cls.__qualname__}"
        if not isinstance(cls.reason, Reason):
            wrong.append(f"{where}: reason {cls.reason!r} is not a member of contract.reasons.Reason")
            continue
        status = CATALOGUE[cls.reason].status
        if status is not None and cls.status_code != status and not cls.__name__.startswith("_"):
            wrong.append(f"{where}: status {cls.status_code}, the catalogue says {status} for {cls.reason}")
    assert wrong == []


def test_the_catalogue_describes_every_reason() -> None:
    assert set(CATALOGUE) == set(Reason)
    assert not ENUMS["Reason"] & ENUMS["ClientReason"]
    for reason, entry in CATALOGUE.items():
        assert re.fullmatch(r"[a-z][a-z_]*[a-z]", reason.value)
        assert entry.meaning and "\n" not in entry.meaning, reason
        assert entry.status is None or 400 <= entry.status <= 599, reason


# --- no reason spelled as a bare string ------------------------------------------------------------


def _named_reason(node: ast.expr) -> bool:
    return ((isinstance(node, ast.Name) and node.id in REASON_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in REASON_NAMES))


def _text(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _literals(node: ast.expr | None) -> list[ast.Constant]:
    """The string literals an expression may evaluate to (`"a"`, `"a" if x else "b"`, `x or "a"`)."""
    if _text(node) is not None:
        return [node]  # type: ignore[list-item]
    if isinstance(node, ast.IfExp):
        return _literals(node.body) + _literals(node.orelse)
    if isinstance(node, ast.BoolOp):
        return [literal for value in node.values for literal in _literals(value)]
    return []


def bare_reasons(source: str) -> list[tuple[int, str]]:
    """(line, string) of each string literal standing where a reason goes."""
    found: list[tuple[int, str]] = []
    tree = ast.parse(source)
    in_class = {id(s) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for s in c.body}
    for node in ast.walk(tree):
        values: list[ast.expr | None] = []
        # a class's reason, or an object's (a local variable named `reason` is free text: a log line's)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(_named_reason(t) and (id(node) in in_class or isinstance(t, ast.Attribute)) for t in targets):
            values.append(node.value)  # type: ignore[union-attr]
        elif isinstance(node, ast.Dict):
            values += [v for k, v in zip(node.keys, node.values, strict=True) if _text(k) == "reason"]
        elif isinstance(node, ast.Call):
            metric = isinstance(node.func, ast.Attribute) and node.func.attr == "labels"  # a metric's label
            values += [k.value for k in node.keywords if k.arg in REASON_NAMES and not metric]
        elif isinstance(node, ast.Compare) and any(_named_reason(n) for n in [node.left, *node.comparators]):
            values += [n for n in [node.left, *node.comparators] if _text(n) not in CREDENTIAL_CAUSES]
        found += [(literal.lineno, literal.value) for value in values for literal in _literals(value)]
    return found


def service_sources() -> Iterator[Path]:
    for path in sorted(SOURCES.rglob("*.py")):
        relative = path.relative_to(SOURCES)
        if relative.parts[0] in SCANNED and relative != Path("contract/reasons.py"):
            yield path


def test_no_reason_is_a_bare_string() -> None:
    found = [f"{path.relative_to(SOURCES)}:{line}: {text!r}"
             + ("" if text in ENUMS["Reason"] | ENUMS["ClientReason"] else " (not even in the catalogue)")
             for path in service_sources() for line, text in bare_reasons(path.read_text())]
    assert found == [], "name reasons from contract.reasons (Reason.X), never as strings"


@pytest.mark.parametrize("planted", [
    'class Gone(NotFound):\n    reason = "gone_for_good"\n',
    'class E(SandpoolClientError):\n    default_reason: str = "at_capacity"\n',
    'def answer():\n    return JSONResponse({"detail": "x", "reason": "teapot"}, status_code=418)\n',
    'def answer():\n    raise Refused(status=400, reason="weird" if x else "odd")\n',
    'def check(body):\n    return body.reason == "not_found"\n',
])
def test_the_scan_finds_a_planted_reason(planted: str) -> None:
    assert bare_reasons(planted) != []


def test_the_scan_leaves_other_strings_alone() -> None:
    source = ('class Gone(NotFound):\n    reason = Reason.NOT_FOUND\n'
              'metrics.reaped.labels(reason="dead").inc()\n'
              'if failure.reason != "unknown_key":\n    pass\n'
              'log.info("refused", extra={"why": "expired"})\n')
    assert bare_reasons(source) == []


def test_every_catalogue_entry_is_used() -> None:
    used = set()
    for path in service_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ENUMS:
                used.add(node.attr)
    catalogued = {r.name for r in Reason}
    assert catalogued - used - RETIRED == set(), "catalogued reasons nothing answers"
    assert used & RETIRED == set(), "a retired reason is answered again: it is no longer retired"
    assert {r.name for r in ClientReason} - used == set()


# --- docs/api.md ---------------------------------------------------------------------------------


def doc_reasons_table() -> dict[str, str]:
    text = API_DOC.read_text()
    section = text.split("\n## Reasons\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", section, flags=re.M)
    assert rows, "docs/api.md has no Reasons table"
    table = dict((reason, status.strip()) for reason, status in rows)
    assert len(table) == len(rows), "a reason listed twice"
    return table


def test_the_docs_list_exactly_the_catalogue_with_its_statuses() -> None:
    table = doc_reasons_table()
    assert set(table) == ENUMS["Reason"]
    for reason, entry in CATALOGUE.items():
        assert table[reason] == (str(entry.status) if entry.status is not None else "varies"), reason


def test_every_status_and_reason_the_docs_mention_agree_with_the_catalogue() -> None:
    text = API_DOC.read_text()
    tables = re.findall(r"^\| status \| reason \| when \|\n((?:\|.*\n)+)", text, flags=re.M)  # per operation
    assert len(tables) >= 3
    rows = [re.match(r"\| (\d{3}) \| ([^|]*) \|", row) for table in tables for row in table.splitlines()[1:]]
    pairs = [(row[1], reason) for row in rows if row for reason in re.findall(r"`([a-z_]+)`", row[2])]
    pairs += re.findall(r"\b(\d{3}) `([a-z_]+)`", text)  # prose: "400 `is_a_directory`"
    pairs += re.findall(r"`(\d{3}) ([a-z_]+)`", text)  # the streaming table: "`502 sandbox_failed`"
    assert len(pairs) > 20
    wrong = [(status, reason) for status, reason in pairs
             if reason not in ENUMS["Reason"] or CATALOGUE[Reason(reason)].status not in (int(status), None)]
    assert wrong == []


# --- the client ----------------------------------------------------------------------------------


def test_the_client_maps_every_reason() -> None:
    """A reason with a client class of its own gets that class; any other, its status's class (a 503's:
    `Unavailable`); retryable exactly for 429, 502 and 503, as docs/client.md says."""
    classes = [SandpoolClientError, *all_subclasses(SandpoolClientError)]
    dedicated = {cls.default_reason: cls for cls in classes if isinstance(cls.default_reason, Reason)}
    assert len(dedicated) >= 10
    for reason, entry in CATALOGUE.items():
        status = entry.status if entry.status is not None else 418
        cls = error_class_for(status, reason)
        assert cls is dedicated.get(reason, cls), reason
        assert issubclass(cls, Unavailable if status == 503 else error_class_for(status, None)), reason
        assert cls.retryable == (status in (429, 502, 503)), reason
        error = error_from_response(status, {}, {"detail": "x", "reason": reason.value})
        assert type(error) is cls and error.reason == reason and error.status == status
    for cls in classes:
        assert cls.default_reason is None or cls.default_reason.value in ENUMS["Reason"] | ENUMS["ClientReason"]


# --- outcome labels --------------------------------------------------------------------------------


def agent_outcome_labels() -> set[str]:
    """The labels the agent's sources assign to an outcome label (string literals or Outcome members)."""
    labels: set[str] = set()
    for path in sorted((SOURCES / "agent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and "outcome_label" in t.id
                                                    for t in node.targets):
                for part in ast.walk(node.value):
                    if _text(part) is not None:  # type: ignore[arg-type]
                        labels.add(part.value)  # type: ignore[attr-defined]
                    elif isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) \
                            and part.value.id == "Outcome":
                        labels.add(Outcome[part.attr].value)
    return labels


def test_the_agents_outcome_labels_are_the_apis_metric_labels() -> None:
    assert agent_outcome_labels() == {o.value for o in Outcome}
    assert set(EXEC_OUTCOMES) == {o.value for o in Outcome}
