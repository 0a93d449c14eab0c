"""A config file and its overrides are read as written: YAML 1.2's numbers, merge keys, one line per mistake
(tasks/core/config_yaml.py, tasks/core/config.py). The contract itself (exit 2, nothing written) for such lines:
tests/test_bad_input.py."""

from __future__ import annotations

import json

import pytest

from tasks.core.config import load_config
from tasks.core.errors import UserError

TINY = "configs/tiny.yaml"
DEMO = "tasks.rewards.demo:successor_reward"


def _file(tmp_path, text: str) -> str:
    base = (open(TINY).read()).replace("name: tiny-demo", "name: from-the-file")
    assert "from-the-file" in base
    path = tmp_path / "c.yaml"
    path.write_text(base + text)
    return str(path)


def _refused(path, overrides=()) -> str:
    with pytest.raises(UserError) as e:
        load_config(path, list(overrides))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_numbers_are_read_as_yaml_1_2_reads_them(tmp_path):
    """YAML 1.1 (PyYAML's) read 010 as 8, 1:30 as 90, 0b11 as 3 and 1e-3 as text: the plan showed 8 iterations
    for 010; a function's kwargs got the string '1e-3'; yes/on were true and 2020-01-01 a date."""
    cfg = load_config(TINY, ["run.iterations=010", "generate.num_generations=0x4", "train.lr=1e-3",
                             f"reward.functions=[{{fn: {DEMO}, kwargs: {{scale: 1e-3, flag: yes, day: 2020-01-01}}}}]"])
    assert cfg.run.iterations == 10 and cfg.generate.num_generations == 4 and cfg.train.lr == 0.001
    assert cfg.reward.functions[0].kwargs == {"scale": 0.001, "flag": "yes", "day": "2020-01-01"}
    assert "run.iterations" in _refused(TINY, ["run.iterations=1:30"])
    assert "generate.num_generations" in _refused(TINY, ["generate.num_generations=0b11"])
    assert "run.name: input should be a valid string" not in _refused(TINY, ["run.name=2020-01-01", "run.seed=x"])


def test_merge_keys_work_and_a_key_twice_is_still_refused(tmp_path):
    path = _file(tmp_path, f"\nshared: &f {{fn: {DEMO}, weight: 1.0}}\n")
    refused = _refused(path)
    assert "unknown key 'shared'" in refused                      # (an anchor's home must be a known key)
    path = tmp_path / "m.yaml"
    own = '  functions:\n    - {fn: "tasks.rewards.demo:successor_reward", weight: 1.0}\n'
    assert own in open(TINY).read()
    path.write_text(open(TINY).read().replace(own, f"  functions: [&f {{fn: {DEMO}, weight: 1.0}}, "
                                              "{<<: *f, weight: 0.5}]\n"))
    cfg = load_config(str(path))
    assert [(f.fn, f.weight) for f in cfg.reward.functions] == [(DEMO, 1.0), (DEMO, 0.5)]
    path.write_text(open(TINY).read() + "\nrun: {name: a}\n")
    assert "appears twice in one mapping" in _refused(str(path))


@pytest.mark.parametrize("text,expected", [
    ("\n? [a, b]\n: 1\n", "not valid YAML: found unhashable key"),                       # (was a traceback)
    ('\nextra: "open\n  more: 1\n\n', "(while scanning a quoted scalar, from line"),     # (where it began)
    ("\nextra: !!python/object/apply:os.system ['true']\n", "python/object/apply:os.system' is not a tag"),
    ("\n1: x\n", "key 1 is int; keys are text"),
    ("\nnull: x\n", "key null is NoneType; keys are text"),
])
def test_a_yaml_mistake_is_one_line_that_says_what_and_where(tmp_path, text, expected):
    said = _refused(_file(tmp_path, text))
    assert said.startswith(f"config: {tmp_path / 'c.yaml'}") and expected in said, said


@pytest.mark.parametrize("text,expected", [("[]\n", "got list"), ("false\n", "got bool"), ("0\n", "got int")])
def test_a_file_that_is_not_a_mapping_says_so_with_or_without_overrides(tmp_path, text, expected):
    (tmp_path / "c.yaml").write_text(text)
    for overrides in ([], ["run.iterations=1"]):
        assert f"expected a mapping of sections at the top level, {expected}" in _refused(tmp_path / "c.yaml",
                                                                                          overrides)


def test_a_mapping_given_for_a_section_is_merged_into_it(tmp_path):
    """-o 'run={iterations: 1}' replaced the whole run section: the file's run.name was dropped and the run
    trained and published under the default name (it could resume another run)."""
    cfg = load_config(_file(tmp_path, ""), ["run={iterations: 1}"])
    assert (cfg.run.name, cfg.run.iterations) == ("from-the-file", 1)
    assert load_config(_file(tmp_path, ""), ["run.name=other"]).run.name == "other"


def test_of_a_key_given_twice_the_last_is_used_and_a_tune_trial_sets_its_own():
    """Commands built from a base list and a change rely on the last one winning (refusing it was tried and
    withdrawn the same day: tests and benches build them so); a mapping for a section is opened into its keys,
    so that a tune trial leaves out the keys it sets itself (`-o 'run={name: a, iterations: 2}'`)."""
    from flows.tune_space import not_set_by

    assert load_config(TINY, ["train.lr=1e-3", "train.lr=2e-3"]).train.lr == 2e-3
    assert load_config(TINY, ["run.name=a", "run={name: b}"]).run.name == "b"
    assert not_set_by(["run={name: a, iterations: 2}", "env.kwargs={a: 1}", "train.lr=0.1"], ["run.name", "train.lr"]) \
        == ["run.iterations=2", 'env.kwargs={"a": 1}']


@pytest.mark.parametrize("value,expected", [
    (f'[{{"fn": "{DEMO}"', "override reward.functions: its value is not valid YAML or JSON"),
    ('"unclosed', "override reward.functions: its value is not valid YAML or JSON"),
])
def test_a_value_that_begins_as_json_and_is_not_is_refused_not_taken_as_text(value, expected):
    assert _refused(TINY, [f"reward.functions={value}"]).startswith(expected)


def test_what_json_cannot_hold_and_another_learners_setting_are_checked():
    """.nan reached a function's kwargs and the fingerprint; train.gamma=abc under grpo was a warning only."""
    assert "kwargs: a: nan is not a finite number" in _refused(
        TINY, [f"reward.functions=[{{fn: {DEMO}, kwargs: {{a: .nan}}}}]"])
    assert "learner.gamma: input should be a valid number" in _refused(TINY, ["train.learner.gamma=abc"])
    assert "learner.gamma: input should be less than or equal to 1" in _refused(TINY, ["train.learner.gamma=5"])
    assert load_config(TINY, ["train.learner.replay_iterations=2"]).train.algorithm == "grpo"   # (ignored: said)


def test_what_rlflow_writes_as_a_config_reads_back_as_itself(tmp_path):
    """The detached trainer's config and tune's best.yaml were written by SafeDumper, which leaves bare the
    strings YAML 1.1 reads as text: "1e-3", "08" and "0o17" came back as numbers under the 1.2 rules."""
    from tasks.core.config_yaml import dump_yaml, load_yaml

    texts = ["1e3", "1e-3", "08", "0o17", "yes", "on", "2020-01-01", "1:30", "010", "True", "null", "", ".5", "é"]
    kwargs = {f"k{i}": t for i, t in enumerate(texts)} | {"n": [1, -0.0, 1e-5, True, None]}
    cfg = load_config(TINY, ["run.name=v1e-3", "reward.functions=" + json.dumps(
        [{"fn": DEMO, "kwargs": kwargs}])])
    dumped = cfg.model_dump(mode="json")
    assert load_yaml(dump_yaml(dumped), "t") == dumped
    (tmp_path / "back.yaml").write_text(dump_yaml(dumped))
    assert load_config(tmp_path / "back.yaml") == cfg


def test_an_override_of_a_text_field_is_the_text_typed():
    """`-o run.name=08` was the number 8, refused ("input should be a valid string, got 8"); `1e-3`, `true` and
    `42` too: for a field of text alone the value is the text as typed. Numbers stay numbers elsewhere."""
    names = {raw: load_config(TINY, [f"run.name={raw}"]).run.name for raw in ("08", "1e-3", "true", "42")}
    assert names == {"08": "08", "1e-3": "1e-3", "true": "true", "42": "42"}
    assert load_config(TINY, ["data.system_prompt=3.5"]).data.system_prompt == "3.5"      # (str or None)
    assert load_config(TINY, ["run.seed=08"]).run.seed == 8 and load_config(TINY, ["train.lr=1e-3"]).train.lr == 1e-3
    assert load_config(TINY, ["data.system_prompt=null"]).data.system_prompt is None


@pytest.mark.parametrize("key,near", [("TRAIN.lr", "train"), ("train.LR", "train.lr"), ("Run.name", "run")])
def test_a_key_in_other_letters_case_is_named_as_it_is_spelt(key, near):
    """`train.LR` had no "did you mean" (difflib found 'lr' too far from 'LR')."""
    assert _refused(TINY, [f"{key}=1"]).endswith(f"; did you mean {near!r}?")


def test_a_config_file_past_16_mb_is_one_line_before_it_is_read(tmp_path):
    """A 60 MB file named as the config was read whole and parsed (about a minute) before any word."""
    big = tmp_path / "big.yaml"
    with open(big, "w") as f:
        f.truncate((16 << 20) + 1)
    assert _refused(big) == (f"config: {big}: 16,777,217 bytes, past a config's 16,777,216; expected a YAML config "
                             f"file (data goes in a file data.path names)")
