"""docs/configuration.md is generated from the settings; a stale copy fails here."""

from __future__ import annotations

from pathlib import Path

from sandpool.configref import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_is_current() -> None:
    expected = render()
    assert "SANDPOOL_POOL_SIZE" in expected
    assert DOC.read_text() == expected, "run: python -m sandpool.configref > docs/configuration.md"
