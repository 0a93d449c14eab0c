"""docs/configuration.md is generated from the config models; it must not drift from them."""

from pathlib import Path

import pytest

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


def test_learner_settings_written_flat_are_read_into_their_section(tmp_path, capsys):
    """Issue 28 moved each learner's settings from `train` into train.learner (a section per train.algorithm):
    the old flat keys, in a file or as overrides, give the same config and the same fingerprint as the new
    ones, with one warning line per key naming its new place; a key set both ways is refused; another
    learner's setting is ignored with a line (a ppo config run with algorithm grpo)."""
    import pytest
    import yaml

    from tasks.core.config import TrainConfig, load_config
    from tasks.core.errors import UserError
    from tests.conftest import TINY

    tree = yaml.safe_load(TINY.read_text())
    tree["data"]["path"] = str((TINY.parent / tree["data"]["path"]).resolve())
    tree["train"].update(algorithm="vtrace_awr", gamma=0.9, replay_iterations=3)     # the shape before
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(tree))
    capsys.readouterr()
    flat = load_config(old, ["train.kl_target=0.05"])
    err = capsys.readouterr().err
    assert "warning: config: train.gamma is now train.learner.gamma" in err
    assert "warning: config: train.kl_target is now train.learner.kl_target" in err
    new = load_config(TINY, [f"data.path={tree['data']['path']}", "train.algorithm=vtrace_awr",
                             "train.learner.gamma=0.9", "train.learner.replay_iterations=3",
                             "train.learner.kl_target=0.05"])
    assert capsys.readouterr().err == ""
    assert flat == new and flat.section_hash("train") == new.section_hash("train")
    assert (new.train.learner.gamma, new.train.learner.replay_iterations) == (0.9, 3)
    # an override after the file wins, in either spelling
    assert load_config(old, ["train.learner.gamma=0.5"]).train.learner.gamma == 0.5
    # what a config dumps loads back as itself (the resident trainer's and deepspeed's workers read it so)
    assert load_config(None, base=new.model_dump(mode="json")) == new
    assert TrainConfig(algorithm="ppo", gamma=0.8).learner.gamma == 0.8
    with pytest.raises(UserError, match="train.gamma and train.learner.gamma are both set"):
        TrainConfig.model_validate({"algorithm": "ppo", "gamma": 0.8, "learner": {"gamma": 0.7}})
    capsys.readouterr()
    grpo = load_config(TINY, ["train.algorithm=ppo", "train.learner.gamma=0.9", "train.algorithm=grpo"])
    assert grpo.train.learner == load_config(TINY, []).train.learner
    assert "train.learner.gamma is a setting of ppo, vtrace_awr; train.algorithm is grpo: ignored" in \
        capsys.readouterr().err
    with pytest.raises(UserError, match="unknown key 'train.learner.gama'"):
        load_config(TINY, ["train.learner.gama=0.9"])


def test_surrogate_settings_live_with_the_learners_that_read_them(capsys, monkeypatch):
    """Issue 41 moved the clipped surrogate's settings (loss_type, epsilon, ...) from `train` into the learners
    that use them (grpo, ppo: train.learner). Flat keys are read with one line each; the train fingerprint is
    the one the code before the move computed (pinned below), so stored runs of every learner resume; a
    learner without a surrogate (vtrace_awr) ignores them with a line."""
    from tasks.algorithms.loss import epsilon_high
    from tasks.core import config_base
    from tasks.core.config import load_config
    from tests.conftest import TINY

    monkeypatch.setattr(config_base, "_SAID", set())            # (said once per process: perhaps already said)
    pinned = {("train.loss_type=cispo", "train.epsilon_high=4.0", "train.beta=0.04"): "415ff410be6c6880",
              ("train.algorithm=ppo", "train.loss_type=sapo", "train.sapo_temperature_neg=1.2"): "756558dde8e35eda",
              ("train.algorithm=vtrace_awr",): "a019bd8283e56952"}       # (computed at 890e95f, before the move)
    said = ""
    for flat, fingerprint in pinned.items():
        capsys.readouterr()
        old = load_config(TINY, list(flat))
        said += capsys.readouterr().err        # (each key's line once per process)
        new = load_config(TINY, [k.replace("train.", "train.learner.", 1) if k.split("=")[0] not in
                                 ("train.algorithm", "train.beta") else k for k in flat])
        assert capsys.readouterr().err == ""
        assert old == new and old.section_hash("train") == new.section_hash("train") == fingerprint
    for name in ("loss_type", "epsilon_high", "sapo_temperature_neg"):
        assert f"warning: config: train.{name} is now train.learner.{name} (read as that" in said
    cispo = load_config(TINY, ["train.learner.loss_type=cispo", "train.learner.epsilon_high=4.0"])
    assert (cispo.train.learner.loss_type, epsilon_high(cispo.train.learner)) == ("cispo", 4.0)
    assert "loss_type" not in type(cispo.train).model_fields
    load_config(TINY, ["train.algorithm=vtrace_awr", "train.learner.epsilon=0.3"])
    assert "train.learner.epsilon is a setting of grpo, ppo; train.algorithm is vtrace_awr: ignored" in \
        capsys.readouterr().err


def test_docs_quote_config_files_as_they_are():
    """A YAML block in the docs or the README whose first line names a file of configs/ in parentheses
    quotes that file: each of its settings is in the file, with the same value (issue 33: docs/operations.md
    cited a tuning key configs/spaces/tiny.yaml does not have). Every table heading of the generated reference
    is a whole sentence (its parentheses closed)."""
    import re

    import yaml

    root = Path(__file__).resolve().parents[1]
    quoted = 0
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S):
            cited = re.match(r"#[^\n]*\((configs/[\w/.-]+\.ya?ml)\)", block)
            if not cited:
                continue
            quoted += 1
            shown, actual = yaml.safe_load(block) or {}, yaml.safe_load((root / cited[1]).read_text())
            for key, value in shown.items():
                assert key in actual, f"{doc.name} quotes {cited[1]} with {key}, which the file does not have"
                assert actual[key] == value, f"{doc.name}: {cited[1]}'s {key} is {actual[key]!r}, not {value!r}"
    assert quoted >= 1
    for heading in re.findall(r"^## .*$", reference_markdown(), re.M):
        assert heading.count("(") == heading.count(")"), f"a heading cut mid-sentence: {heading}"


def test_every_number_in_the_config_has_a_range():
    """A number with no upper bound reached the libraries (`train.lora_r=1e20`: peft's traceback from preflight;
    `generate.num_generations=1e20` was planned): every int and float field, of every section and learner, has
    one, so a value past any real run's is the config's one line."""
    import typing

    import annotated_types
    from pydantic import BaseModel

    from tasks.core.config import Config
    from tasks.core.config_train import LEARNER_CONFIGS

    def models_in(annotation):
        for arg in typing.get_args(annotation) or (annotation,):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield arg
            elif typing.get_args(arg):
                yield from models_in(arg)

    unbounded, seen = [], set()

    def walk(model, prefix):
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            for inner in models_in(field.annotation):
                walk(inner, f"{prefix}{name}.")
            if typing.get_origin(field.annotation) is tuple:       # adam_betas, uid_range: their validators bound
                continue
            kinds = set(typing.get_args(field.annotation) or (field.annotation,))
            if kinds & {int, float} and not any(isinstance(m, (annotated_types.Le, annotated_types.Lt))
                                                for m in field.metadata):
                unbounded.append(prefix + name)

    walk(Config, "")
    for algorithm, learner in LEARNER_CONFIGS.items():
        walk(learner, f"train.learner[{algorithm}].")
    assert len(seen) > 20 and not unbounded, unbounded


@pytest.mark.parametrize("overrides, line", [
    (["train.learner.sapo_temperature_pos=2"], "train.learner.sapo_temperature_pos is set to 2.0 but has no effect: "
                                               "only loss_type sapo uses it (it is dapo)"),
    (["train.learner.loss_type=cispo", "train.learner.delta=2"], "train.learner.delta is set to 2.0 but has no "
                                                                 "effect: the clipped losses"),
    (["train.learner.loss_type=sapo", "train.learner.epsilon_high=0.3"], "train.learner.epsilon_high is set to 0.3"),
    (["train.learner.advantage=rloo", "train.learner.scale_rewards=batch"],
     "train.learner.scale_rewards is set to \"batch\" but has no effect: only advantage group uses it (it is rloo)"),
    (["train.algorithm=ppo", "train.learner.kl_in_reward=true"], "train.learner.kl_in_reward is set to true but "
                                                                 "has no effect: it moves the KL term, and "
                                                                 "train.beta is 0"),
    (["train.learner.use_bias_correction_kl=false"], "train.learner.use_bias_correction_kl is set to false"),
    (["train.lora_target_modules=[q_proj]"], "train.lora_target_modules is set to [\"q_proj\"] but has no effect: "
                                             "train.lora_r is 0 (full fine-tuning)"),
    (["train.importance_sampling_correction=false", "train.importance_sampling_cap=2"],
     "train.importance_sampling_cap is set to 2.0 but has no effect: train.importance_sampling_correction is false"),
    (["train.offload_optimizer=true"], "train.offload_optimizer is set to true but has no effect: train.engine is "
                                       "torch"),
    (["generate.enforce_eager=true"], "generate.enforce_eager is set to true but has no effect: generate.engine "
                                      "is hf"),
    (["generate.replica_threads=1"], "generate.replica_threads is set to 1 but has no effect: generate.replicas is 0"),
    (["generate.engine=vllm", "generate.share_prompts=false"], "generate.share_prompts is set to false but has no "
                                                               "effect: vLLM shares prompts' prefixes itself"),
    (["env.max_turns=9"], "env.max_turns is set to 9 but has no effect: neither env.factory nor env.agent is set"),
    (["env.factory=tasks.envs.builtin.games:SayTheLetters", "env.endpoint={min_top_p: 0.5}"],
     "env.endpoint is set to {\"temperature\": null, \"min_top_p\": 0.5} but has no effect: it bounds an agent's "
     "requests"),
    (["train.mode=process", "train.checkpoint_every=5"], "train.checkpoint_every is set to 5 but has no effect: "
                                                         "train.mode process"),
    (["train.off_policy_loss=decoupled", "train.importance_sampling_mode=sequence_mask"],
     "train.importance_sampling_mode is set to \"sequence_mask\" but has no effect: off_policy_loss decoupled"),
    (["data.path=null", "data.reasoning_gym={task: basic_arithmetic}", "data.split=test"],
     "data.split is set to \"test\" but has no effect: data.reasoning_gym makes its own train and held-out splits"),
    (["train.algorithm=ppo", "train.learner.critic_warmup=5", "run.iterations=5"],
     "train.learner.critic_warmup 5 with run.iterations 5: the first 5 iterations train the critic alone, so this "
     "run never updates the policy"),
])
def test_a_setting_the_rest_of_the_config_makes_do_nothing_is_warned_of(capsys, monkeypatch, overrides, line):
    """A value given to a setting that the chosen loss, advantage, engine or KL coefficient never reads (TRL
    ignores such settings silently: a value tuned there is lost without a word) is one warning line as the
    config is read; not for the default value, not where it is read, not again where the config is handed on."""
    from tasks.core import config_base
    from tasks.core.config import load_config
    from tests.conftest import TINY

    monkeypatch.setattr(config_base, "_SAID", set())
    cfg = load_config(TINY, overrides)
    err = capsys.readouterr().err
    assert f"warning: config: {line}" in err or f"warning: {line}" in err, err
    config_base._SAID.clear()
    type(cfg).model_validate(cfg.model_dump())                 # (a stage process given the config: not again)
    assert capsys.readouterr().err == ""


def test_a_setting_read_or_at_its_default_is_not_warned_of(capsys, monkeypatch):
    from tasks.core import config_base
    from tasks.core.config import load_config
    from tests.conftest import TINY

    monkeypatch.setattr(config_base, "_SAID", set())
    for overrides in (["train.learner.loss_type=sapo", "train.learner.sapo_temperature_pos=2"],
                      ["train.learner.sapo_temperature_pos=1.0"],                      # the default
                      ["train.learner.loss_type=cispo", "train.learner.epsilon_high=4"],
                      ["train.beta=0.04", "train.learner.use_bias_correction_kl=false"],
                      ["train.lora_r=4", "train.lora_alpha=8"],
                      ["train.algorithm=ppo", "train.learner.critic_warmup=2", "run.iterations=5"],
                      ["generate.engine=vllm", "generate.enforce_eager=true", "generate.share_prompts=true"],
                      ["env.factory=tasks.envs.builtin.games:SayTheLetters", "env.max_turns=9"],
                      ["env.agent=tasks.envs.builtin.games:letters_agent", "env.endpoint={min_top_p: 0.5}"],
                      ["train.mode=resident", "train.checkpoint_every=5"]):
        load_config(TINY, overrides)
        assert "warning" not in capsys.readouterr().err, overrides


@pytest.mark.parametrize("kind, setting", [("classifier", "verdict_tokens: [A, B]"), ("verdict", "label: 1"),
                                           ("judge", "score: probability"), ("classifier", "scale: [0, 10]"),
                                           ("classifier", "system: be fair")])
def test_a_reward_model_setting_of_another_kind_is_warned_of(kind, setting, capsys, monkeypatch):
    """A reward model's setting that its kind never reads (a classifier's verdict tokens: scored by its label
    alone) is one warning line; a warning, not a refusal, so that a stored run whose config has one resumes.
    max_tokens is every kind's (a vLLM judge server's max_model_len counts it): not warned of."""
    from tasks.core import config_base
    from tasks.core.config import load_config
    from tests.conftest import TINY

    monkeypatch.setattr(config_base, "_SAID", set())
    template = "" if kind == "classifier" else ", template: 'Is {completion} right?'"
    spec = f"{{name: j, kind: {kind}, model: builtin:smollm2-135m, sha256: {'a' * 64}{template}, {setting}}}"
    load_config(TINY, [f"reward.models=[{spec}]"])
    err = capsys.readouterr().err
    assert f"warning: config: reward.models (j).{setting.split(':')[0]} is set to " in err and \
        f"but has no effect: a {kind} does not read it (a setting of kind " in err, err
    load_config(TINY, [f"reward.models=[{spec.replace(setting, 'max_tokens: 8')}]"])
    assert capsys.readouterr().err == ""


def test_a_local_files_split_may_be_a_slice():
    """`datasets`' split syntax (train[:3]) on a local file: the file is the split, the slice taken from it (the
    split name keyed the file, so a slice was `datasets`' error, blamed on data.path)."""
    from tasks.core.config import load_config
    from tasks.core.data import load_prompts
    from tests.conftest import TINY

    whole = load_prompts(load_config(TINY, []))
    part = load_prompts(load_config(TINY, ["data.split=train[:3]"]))
    assert len(whole) > 3 and part["prompt"] == whole["prompt"][:3]
