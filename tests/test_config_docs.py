"""docs/configuration.md is generated from the config models; it must not drift from them."""

from pathlib import Path

from tasks.core.config import reference_markdown


def test_configuration_reference_is_current():
    doc = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert doc.read_text() == reference_markdown() + "\n", "run: python -m tasks.core.config > docs/configuration.md"


def test_fields_added_later_enter_fingerprints_only_when_set():
    """A field marked SINCE_DEFAULT leaves the fingerprint alone at its default (runs made before it existed
    resume), and changes it when set; a HOW_NOT_WHAT field never does."""
    from tasks.core.config import load_config
    from tests.conftest import TINY

    base = load_config(TINY, [])
    same = load_config(TINY, ["train.advantage=group", "reward.sandbox.cgroup=auto", "reward.sandbox.cpus=1.0"])
    assert same.section_hash("train", "reward") == base.section_hash("train", "reward")
    assert load_config(TINY, ["train.advantage=rloo"]).section_hash("train") != base.section_hash("train")
    assert load_config(TINY, ["reward.sandbox.cpus=2"]).section_hash("reward") != base.section_hash("reward")
    assert load_config(TINY, ["train.checkpoint_every=3"]).section_hash("train") == base.section_hash("train")
