"""The egress refusal words are declared once (`contract.reasons.EgressRefusal`, with their statuses): the
proxy and the sandbox's relay name them from there, never as strings, and docs/egress.md lists exactly them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sandpool.contract.reasons import EGRESS_REFUSALS, EgressRefusal
from sandpool.egress.http import Refusal

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*sorted((ROOT / "services" / "sandpool" / "egress").glob("*.py")),
           ROOT / "services" / "sandpool" / "agent" / "egress.py"]
DOC = ROOT / "docs" / "egress.md"
WORDS = {word.value for word in EgressRefusal}


def spelled_out(source: str) -> list[tuple[int, str]]:
    """(line, word) of each string literal that is a refusal word."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in WORDS]


def test_no_refusal_word_is_spelled_as_a_string() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {word!r}" for path in SOURCES
             for line, word in spelled_out(path.read_text())]
    assert found == [], "name refusal words from contract.reasons (EgressRefusal.X)"


def test_the_scan_finds_a_planted_word() -> None:
    assert spelled_out('raise Refusal("not_allowed", "sandpool egress: no")') == [(1, "not_allowed")]


def test_every_word_is_used() -> None:
    used = {node.attr for path in SOURCES for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "EgressRefusal"}
    assert {word.name for word in EgressRefusal} - used == set()


def test_the_catalogue_describes_every_word() -> None:
    assert set(EGRESS_REFUSALS) == set(EgressRefusal)
    for word, entry in EGRESS_REFUSALS.items():
        assert re.fullmatch(r"[a-z][a-z_]*[a-z]", word.value) and entry.meaning, word
        assert all(400 <= status <= 599 for status in entry.statuses), word


def doc_table() -> dict[str, str]:
    section = DOC.read_text().split("\n### Refusal words\n", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", section, flags=re.M)
    table = {word: status.strip() for word, status in rows}
    assert rows and len(table) == len(rows), "docs/egress.md: no refusal-words table, or a word listed twice"
    return table


def test_the_docs_list_exactly_the_words_with_their_statuses() -> None:
    table = doc_table()
    assert set(table) == WORDS
    for word, entry in EGRESS_REFUSALS.items():
        assert table[word] == (", ".join(map(str, entry.statuses)) or "none: the tunnel is cut"), word


def test_a_refusal_takes_its_status_from_the_catalogue() -> None:
    assert Refusal(EgressRefusal.NOT_ALLOWED, "no").status == 403
    assert Refusal(EgressRefusal.TOO_MANY_CONNECTIONS, "full", status=503).status == 503
    with pytest.raises(ValueError):
        Refusal(EgressRefusal.TOO_MANY_CONNECTIONS, "which status?")
    with pytest.raises(ValueError):
        Refusal(EgressRefusal.NOT_ALLOWED, "not its status", status=404)
    with pytest.raises(ValueError):
        Refusal(EgressRefusal.NOT_TLS, "a cut tunnel has no HTTP answer")
