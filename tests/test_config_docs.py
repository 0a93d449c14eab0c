"""docs/configuration.md is generated from the config models; it must not drift from them."""

from pathlib import Path

from tasks.core.config import reference_markdown


def test_configuration_reference_is_current():
    doc = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert doc.read_text() == reference_markdown() + "\n", "run: python -m tasks.core.config > docs/configuration.md"
