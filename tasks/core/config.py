"""Typed run configuration: YAML file < dotted CLI overrides; unknown keys are errors.

    cfg = load_config("configs/tiny.yaml", ["train.lr=1e-3", "run.iterations=5"])

One model per stage (GenerateConfig, RewardConfig, TrainConfig, PublishConfig) plus the shared parts
(run, model, data, store, tracking). Names follow TRL where TRL has the concept.
Relative paths in a config file resolve against that file's folder; paths given as overrides against the
current directory.

Here: the whole config (`Config`, its checks across sections, its fingerprints), loading it, and the generator
of docs/configuration.md (`python -m tasks.core.config`). The sections' models live in config_inputs,
config_generate, config_reward, config_train, config_publish and config_infra (on config_base), and are
re-exported here: import them from this module.
More: docs/internals.md (tasks/core/config.py): how the config is split, loaded and fingerprinted.
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import Field, ValidationError, model_validator

from tasks.core.config_base import _HELD, HOW_NOT_WHAT, SINCE_DEFAULT, Section, moved, warn, without_effect
from tasks.core.config_generate import (
    MOVED_ENV_MODULES,
    PATH_AS_BEFORE_THE_MOVE,
    DynamicSamplingConfig,
    EndpointConfig,
    EnvConfig,
    GenerateConfig,
    path_before_the_move,
)
from tasks.core.config_infra import (
    STAGES,
    TRACKING_SCHEMES,
    CostConfig,
    KeepConfig,
    LauncherConfig,
    Stage,
    StageWhere,
    StoreConfig,
    TrackingConfig,
)
from tasks.core.config_inputs import CurriculumConfig, DataConfig, ModelConfig, ReasoningGymConfig, RunConfig
from tasks.core.config_publish import EvalConfig, PublishConfig
from tasks.core.config_reward import OverlongConfig, RewardConfig, RewardFunction, RewardModel, SandboxConfig
from tasks.core.config_train import (
    BUILT_IN_LEARNERS,
    FLAT_IN_FINGERPRINT,
    LEARNER_CONFIGS,
    LEARNER_KEYS,
    GrpoConfig,
    LearnerConfig,
    PpoConfig,
    SurrogateConfig,
    TrainConfig,
    ValueLearnerConfig,
    VtraceAwrConfig,
    _migrate_train,
)
from tasks.core.config_warmup import WarmupConfig
from tasks.core.config_yaml import DuplicateKey, load_yaml, problem
from tasks.core.errors import UserError, printable
from tasks.core.hashing import digest

__all__ = [  # the sections' models, re-exported: `from tasks.core.config import X` for every X of the config
    "Section", "HOW_NOT_WHAT", "SINCE_DEFAULT", "moved", "warn",
    "RunConfig", "ModelConfig", "ReasoningGymConfig", "CurriculumConfig", "DataConfig",
    "DynamicSamplingConfig", "GenerateConfig", "EndpointConfig", "EnvConfig", "MOVED_ENV_MODULES",
    "PATH_AS_BEFORE_THE_MOVE", "path_before_the_move",
    "RewardFunction", "SandboxConfig", "RewardModel", "OverlongConfig", "RewardConfig",
    "LearnerConfig", "SurrogateConfig", "GrpoConfig", "ValueLearnerConfig", "PpoConfig", "VtraceAwrConfig",
    "LEARNER_CONFIGS", "BUILT_IN_LEARNERS", "LEARNER_KEYS", "FLAT_IN_FINGERPRINT", "TrainConfig", "WarmupConfig",
    "KeepConfig", "StoreConfig", "TRACKING_SCHEMES", "TrackingConfig", "Stage", "STAGES", "StageWhere",
    "PublishConfig", "EvalConfig", "LauncherConfig", "CostConfig", "Config", "load_config", "reference_markdown",
]


class Config(Section):
    """A whole run. Sections left out take their defaults."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig
    generate: GenerateConfig = GenerateConfig()
    reward: RewardConfig
    env: EnvConfig = EnvConfig()
    train: TrainConfig = TrainConfig()
    warmup: WarmupConfig | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="SFT on demonstrations before iteration 1 (tasks/sft.py); "
        "its result is the starting policy v0 (None: RL starts from model.name_or_path).")
    publish: PublishConfig = PublishConfig()
    eval: EvalConfig = EvalConfig()
    store: StoreConfig = StoreConfig()
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)    # (reads $MLFLOW_TRACKING_URI when made)
    launcher: LauncherConfig = LauncherConfig()
    cost: CostConfig = CostConfig()

    @property
    def resident_trainer(self) -> bool:
        """Whether a resident trainer trains this run: train.mode, with auto resolved on the machine that asks:
        resident, unless the train stage runs as SkyPilot managed jobs (whose cluster ends with each job) or
        inside a torchrun started by hand (tasks/train.py refuses resident there). On several nodes (NNODES) the
        deepspeed trainer is one resident group across them (tasks/engines/trainer_group.py)."""
        if self.train.mode != "auto":
            return self.train.mode == "resident"
        return not self._managed_train() and "RANK" not in os.environ

    def _managed_train(self) -> bool:
        return self.launcher.managed_jobs and self.launcher.where_of("train") == "sky"

    def env_sections(self) -> tuple[str, ...]:
        """("env",) when episodes are multi-turn: what the stages that sample or score add to their fingerprint
        (left out otherwise, so single-turn runs keep theirs)."""
        return ("env",) if self.env.episodic() else ()

    @model_validator(mode="after")
    def _some_reward(self):
        if not self.reward.functions and not self.reward.models and not self.env.episodic():
            raise ValueError("reward.functions: at least one reward function or reward.models entry is needed (or "
                             "an env.factory or env.agent, whose episodes' return is the reward)")
        return self

    def eval_is_held_out(self) -> bool:
        """Whether the evaluation's prompts are others than the training ones: not where it reads the training
        data file itself (no eval.path, or that same file: a local file is one split, whatever eval.split says),
        nor the same split of the same hub dataset. A reasoning-gym task's eval split is made apart."""
        d, e = self.data, self.eval
        if d.reasoning_gym is not None and not e.path:
            return True
        path = e.path or d.path
        local = Path(str(path)).expanduser()
        if local.exists():
            return local.resolve() != Path(str(d.path)).expanduser().resolve()
        return path != d.path or (e.name or d.name) != d.name or e.split != d.split

    def completion_limit(self) -> int:
        """The most tokens a completion can have after its prompt: an episode's env.max_tokens (the model's and
        the observations'), else generate.max_completion_length."""
        return self.env.max_tokens if self.env.episodic() else self.generate.max_completion_length

    def sequence_limit(self) -> int:
        """The longest sequence a rollout can be: its prompt (generate.max_prompt_length) and completion_limit()."""
        return self.generate.max_prompt_length + self.completion_limit()

    @model_validator(mode="after")
    def _episode_fits_max_model_len(self):
        gc, need = self.generate, self.sequence_limit()
        if gc.engine == "vllm" and self.env.episodic() and gc.max_model_len is not None and gc.max_model_len < need:
            # (a warning, as where the model's context caps it: vLLM stops a sequence there; and a stored run resumes)
            warn(f"warning: generate.max_model_len: {gc.max_model_len} is less than an episode can take: its first "
                 f"prompt (max_prompt_length {gc.max_prompt_length}) and env.max_tokens ({self.env.max_tokens}) after "
                 f"it, {need}: vLLM stops an episode's sequence there, and a later turn's prompt as long as that fails "
                 f"the episode; expected at least {need}, a smaller env.max_tokens, or null")
        return self

    @model_validator(mode="after")
    def _endpoint_bounds_meet(self):
        if self.env.endpoint.min_top_p > self.generate.top_p:
            raise ValueError(f"env.endpoint.min_top_p: {self.env.endpoint.min_top_p:g} is above generate.top_p "
                             f"({self.generate.top_p:g}): a request may only narrow top_p, from generate.top_p down "
                             f"to min_top_p; expected min_top_p <= top_p")
        return self

    @model_validator(mode="after")
    def _something_pays(self):
        rc = self.reward
        weights = [f.weight for f in rc.functions] + [m.weight for m in rc.models] + \
            ([self.env.reward_weight] if self.env.episodic() else [])
        if weights and not any(weights):
            raise ValueError("reward: every weight is 0 (reward.functions, reward.models, env.reward_weight): no "
                             "completion would be paid for anything, every advantage 0; expected a weight that is "
                             "not 0 (weight 0 logs a function beside one that pays)")
        return self

    @model_validator(mode="after")
    def _overlong_inside_the_limit(self):
        ol, limit = self.reward.overlong, self.completion_limit()
        if ol is not None and ol.buffer >= limit:
            what = "env.max_tokens" if self.env.episodic() else "generate.max_completion_length"
            raise ValueError(f"reward.overlong.buffer: {ol.buffer} tokens is not shorter than the completion limit "
                             f"({what} {limit}): every completion would be punished; expected a buffer below "
                             f"{limit}{f' (none is: raise {what}, or drop reward.overlong)' * (limit == 1)}")
        return self

    @model_validator(mode="after")
    def _staleness_within_the_run(self):
        s, n = self.run.max_staleness, self.run.iterations
        # (a warning: a resume may give the run more iterations later; said as a config file is read, not again
        # by each process the config is handed to)
        if s and s >= n - 1 and getattr(_HELD, "lines", None) is not None:
            warn(f"warning: run.max_staleness {s} with run.iterations {n}: iteration N samples from v(N-1-S), so "
                 f"every iteration of this run samples from v0 (the base model, or the warm start's policy) and "
                 f"none from a policy it trained; expected a staleness below run.iterations - 1")
        warmup = getattr(self.train.learner, "critic_warmup", 0)
        if warmup >= n and getattr(_HELD, "lines", None) is not None:
            warn(f"warning: train.learner.critic_warmup {warmup} with run.iterations {n}: the first {warmup} "
                 f"iterations train the critic alone, so this run never updates the policy; expected a warm-up "
                 f"below run.iterations")
        return self

    @model_validator(mode="after")
    def _dropped_groups_teach_nothing(self):
        lc, advantage = self.train.learner, getattr(self.train.learner, "advantage", "group")   # (warned, not refused)
        if self.generate.dynamic_sampling is not None and getattr(_HELD, "lines", None) is not None and \
                (self.train.algorithm != "grpo" or advantage == "reinforce_pp"):
            how = f"train.algorithm {self.train.algorithm}" if self.train.algorithm != "grpo" else \
                f"train.learner.advantage {advantage}"
            warn(f"warning: generate.dynamic_sampling drops the groups whose rewards are all equal, whose advantages "
                 f"are 0 only where they are relative to the group (GRPO's group, rloo, reinforce_pp_baseline); "
                 f"under {how} such a group still has advantages{' (a value model)' if lc.algorithm != 'grpo' else ''}"
                 f": dropping it drops signal")
        return self

    @model_validator(mode="after")
    def _curriculum_outlasts_staleness(self):
        cur, s = self.data.curriculum, self.run.max_staleness
        if cur is not None and cur.defer <= s:
            raise ValueError(f"data.curriculum.defer: {cur.defer} iteration{'s' * (cur.defer > 1)} is not longer "
                             f"than run.max_staleness ({s}): iteration N's groups are known when iteration N+{s}+1 "
                             f"is picked, so a deferral of {s} iterations or fewer never takes effect; expected "
                             f"defer above {s}")
        return self

    @model_validator(mode="after")
    def _one_server_per_machine(self):
        gc = self.generate
        if gc.replicas > 1 and gc.mode == "resident" and self.launcher.where_of("generate") != "sky":
            raise ValueError("generate.replicas: replicas on this machine would share the run's one vLLM server; "
                             "use generate.mode process here, or run generate on sky (a machine per replica)")
        return self

    @model_validator(mode="after")
    def _streaming_can_stream(self):
        gc, sc = self.generate, self.generate.streaming
        if sc is None:
            return self
        if gc.engine == "vllm" and gc.mode == "resident":
            raise ValueError("generate.mode: resident with generate.streaming: the streaming sampler keeps one "
                             "vLLM engine for the run itself, each policy loaded in place; expected generate.mode "
                             "process (the default)")
        # (Placement.scores_as_groups_complete's rule, read from the keys: placement.py imports this module)
        if gc.dynamic_sampling is not None and (self.reward.models or self.launcher.where_of("reward") != "inline"):
            why = "reward.models' judges score at the reward stage" if self.reward.models else \
                f"reward runs {self.launcher.where_of('reward')} (launcher)"
            raise ValueError(f"generate.dynamic_sampling with generate.streaming drops a group as soon as the reward "
                             f"functions have scored it, in the flow's process, but {why}; expected reward "
                             f"functions only, the reward stage inline")
        if self.run.max_staleness < 1:
            raise ValueError("generate.streaming needs run.max_staleness >= 1 (a group of iteration N starts once "
                             "v(N-1-S) is loaded; with 0 nothing can be sampled ahead); expected 1 or more")
        if sc.max_rows is not None and sc.max_rows < gc.num_generations:
            raise ValueError(f"generate.streaming.max_rows: {sc.max_rows} rows cannot hold one group "
                             f"(generate.num_generations {gc.num_generations}: a group decodes at once); expected "
                             f"at least {gc.num_generations}")
        if sc.buffer is not None and sc.buffer < gc.prompts_per_iteration:
            raise ValueError(f"generate.streaming.buffer: {sc.buffer} groups is smaller than one iteration's "
                             f"(generate.prompts_per_iteration {gc.prompts_per_iteration}); expected at least that")
        if self.launcher.where_of("generate") != "inline" and not gc.replicas:     # (replicas: they run there)
            raise ValueError(f"generate.streaming: the sampler runs in the flow's process, but generate runs "
                             f"{self.launcher.where_of('generate')} (launcher); expected generate inline, or "
                             f"generate.replicas to decode there (each replica decoding the rows placed on it)")
        return self

    @model_validator(mode="after")
    def _settings_without_effect(self):
        without_effect([(self.publish, "publish", "delta", not self.train.lora_r, "LoRA adapters are published whole")])
        return self

    @model_validator(mode="after")
    def _resident_needs_a_lasting_machine(self):
        if self.train.mode == "resident" and self._managed_train():
            raise ValueError("train.mode: resident needs a train machine that outlives a job; with "
                             "launcher.managed_jobs each sky stage gets a cluster of its own: use train.mode process "
                             "(or auto)")
        return self

    def section_hash(self, *sections: str) -> str:
        """Fingerprint of some sections: a stage's outputs are reused only if its inputs hash the same. Fields
        marked HOW_NOT_WHAT are left out."""
        return digest(self.section_values(*sections))

    def section_values(self, *sections: str) -> dict:
        """What section_hash hashes: the sections' values, without the HOW_NOT_WHAT fields (kept in an output's
        manifest, so a refused resume names the fields that changed: tasks/core/stage.py)."""
        return {s: _what(getattr(self, s)) for s in sections}


def _what(section: Section) -> dict:
    dumped = section.model_dump(mode="json")
    for name, field in type(section).model_fields.items():
        if field.json_schema_extra == HOW_NOT_WHAT or (field.json_schema_extra == SINCE_DEFAULT
                                                       and getattr(section, name) == field.default):
            dumped.pop(name, None)                  # (None: an excluded field is not in the dump)
        elif field.json_schema_extra == FLAT_IN_FINGERPRINT:
            dumped.pop(name)
            dumped.update(_what(getattr(section, name)))
        elif isinstance(extra := field.json_schema_extra, dict) and extra.get("fingerprint") == "values-as-before":
            dumped[name] = extra["before"].get(dumped[name], dumped[name])
        elif field.json_schema_extra == PATH_AS_BEFORE_THE_MOVE:
            dumped[name] = path_before_the_move(getattr(section, name))
        elif isinstance(getattr(section, name), Section):
            dumped[name] = _what(getattr(section, name))
        elif isinstance(getattr(section, name), list) and all(isinstance(x, Section) for x in getattr(section, name)):
            dumped[name] = [_what(x) for x in getattr(section, name)]
    dumped.update({k: v for k, v in getattr(section, "_fingerprint_always", {}).items() if k not in dumped})
    return dumped


# --------------------------------------------------------------------------------------------- loading

_PATH_FIELDS = (("data", "path"), ("model", "name_or_path"), ("eval", "path"), ("warmup", "path"))


def _parse_value(key: str, raw: str) -> Any:
    """An override value is YAML: `3` is an int, `[1, 2]` a list, `{"fn": ...}` a mapping, else a string; one that
    begins as a list, a mapping or a quoted string and is not valid YAML (JSON is) is refused, not taken as text."""
    try:
        return load_yaml(raw, f"override {key}")
    except DuplicateKey as e:
        raise UserError(printable(f"override value {raw!r}: key {e.key!r} appears twice")) from None
    except yaml.YAMLError as e:
        if raw.lstrip().startswith(("[", "{", '"', "'")):
            mark = getattr(e, "problem_mark", None)
            at = f" at character {mark.index + 1}" if mark else ""
            raise UserError(printable(f"override {key}: its value is not valid YAML or JSON: "
                                      f"{getattr(e, 'problem', None) or 'not read'}{at} (to give text that begins "
                                      f"so, quote it whole)")) from None
        return raw


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    """`value` at `key`; a mapping given for a section is merged into it, key by key, as dotted overrides would
    be (`-o 'run={iterations: 1}'` kept nothing of the file's run: the run trained under the default name); a
    free-form mapping (a function's kwargs, env.kwargs, a task's config) is one value: replaced whole."""
    parts, node = key.split("."), tree
    for p in parts[:-1]:
        if not isinstance(nxt := node.setdefault(p, {}), dict):
            raise UserError(f"override {key}: {p} is not a section")
        node = nxt
    node[parts[-1]] = _merged(node.get(parts[-1]), value, parts)


def _merged(old: Any, new: Any, parts: list[str]) -> Any:
    if isinstance(old, dict) and isinstance(new, dict) and new and _a_section(parts):
        return {**old, **{k: _merged(old.get(k), v, [*parts, str(k)]) for k, v in new.items()}}
    return new


def _a_section(parts: list[str]) -> bool:
    """Whether the dotted place `parts` holds a section of the config (not a free-form mapping)."""
    return bool(_models_at(parts))


def leaf_overrides(overrides: list[str]) -> list[str]:
    """The same overrides, each key of a section given as a mapping (`run={name: a, iterations: 2}`) a dotted
    one of its own (`run.name="a"`, `run.iterations=2`): what a caller that sets some keys itself can filter."""
    return [f"{'.'.join(leaf)}={json.dumps(value)}" if value is not _AS_GIVEN else item
            for item in overrides for leaf, value in _leaves(item)]


_AS_GIVEN = object()


def _leaves(item: str) -> list[tuple[tuple, Any]]:
    """(dotted place, value) of each key an override sets, mappings at sections opened (a learner's key read at
    its place in train.learner); one load_config refuses, or a single key, is itself (its value _AS_GIVEN)."""
    key, eq, raw = item.partition("=")
    parts = key.strip().split(".")
    if parts[0] == "train" and len(parts) > 1 and parts[1] in LEARNER_KEYS:
        parts = ["train", "learner", *parts[1:]]
    if not eq or not (raw.lstrip().startswith("{") and isinstance(value := _parse_value(key, raw), dict)):
        return [(tuple(parts), _AS_GIVEN)]
    out, stack = [], [(parts, value)]
    while stack:
        at, v = stack.pop(0)
        if isinstance(v, dict) and v and _a_section(at):
            stack[:0] = [([*at, str(k)], w) for k, w in v.items()]
        else:
            out.append((tuple(at), v))
    return out


def _resolve_relative(tree: dict, base: Path) -> None:
    """Relative paths written in a config file are relative to that file, if such a path exists there."""
    for section, key in _PATH_FIELDS:
        value = tree.get(section, {}).get(key) if isinstance(tree.get(section), dict) else None
        if isinstance(value, str) and value.strip() and not value.startswith(("/", "builtin:")) and "://" not in value:
            candidate = base / value
            if candidate.exists():
                tree[section][key] = str(candidate.resolve())
    # store.uri stays relative to the working directory: that is where the user runs from.


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    parts = [p for i, p in enumerate(e["loc"]) if not (i and e["loc"][i - 1] == "learner" and p in LEARNER_CONFIGS)]
    loc = ".".join(str(p) for p in parts) or "config"         # (without the union's tag: train.algorithm says it)
    got = e.get("input")
    if e["type"] == "extra_forbidden":
        near = _near(parts)
        return f"config: unknown key {loc!r}" + (f"; did you mean {near!r}?" if near else "")
    if e["type"] == "missing":
        return f"config: {loc}: required field is missing"
    shown = json.dumps(got, default=str) if not isinstance(got, dict) else "a mapping"
    shown = shown[:77] + "..." if len(shown) > 80 else shown
    msg = e["msg"].removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:] if msg[:2] != msg[:2].upper() else msg    # ("Input should..."; a pattern as is)
    if not e["loc"] and isinstance(got, dict):     # a check of the whole config names its own fields
        return f"config: {msg}"
    if isinstance(got, dict) and e["type"] == "value_error":     # a section's own check says what it got
        return f"config: {loc}: {msg}"
    return f"config: {loc}: {msg}, got {shown}"


def _sections_in(annotation) -> list[type[Section]]:
    """The Section models a field's type holds (itself, a list's items, an optional's, a union's members;
    train.learner's: every registered learner's settings)."""
    if annotation is LearnerConfig:
        return list(LEARNER_CONFIGS.values())
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _sections_in(arg)]


def _models_at(parts: list) -> list[type[Section]]:
    """The Section models at the dotted place `parts` of the config (none: not a section there)."""
    models: list[type[Section]] = [Config]
    for p in parts:
        if isinstance(p, int):
            continue                          # an item of a list of sections
        fields = [m.model_fields.get(str(p)) for m in models]
        models = [s for f in fields if f is not None for s in _sections_in(f.annotation)]
    return models


def _text_field(parts: list) -> bool:
    """Whether the dotted place `parts` is a field of text alone (str, or str or None) in every section there."""
    fields = [m.model_fields.get(str(parts[-1])) for m in _models_at(parts[:-1])]
    return bool(fields) and all(f is not None and (f.annotation is str or str in get_args(f.annotation)
                                                   and set(get_args(f.annotation)) <= {str, type(None)})
                                for f in fields)


def _near(parts: list) -> str | None:
    """The known key closest to an unknown one, among the keys of the models at the same place: the one whose
    words' initials it spells (train.learning_rate -> train.lr), the only one it begins, or difflib's closest;
    as a dotted key; None if none is close."""
    import difflib

    models = _models_at(parts[:-1])
    names = {name for m in models for name, f in m.model_fields.items() if not f.exclude}
    leaf = str(parts[-1])
    initials = "".join(w[:1] for w in leaf.split("_"))
    near = [n for n in sorted(names) if len(n) > 1 and n == initials]
    starts = [n for n in sorted(names) if len(leaf) > 2 and n.startswith(leaf)]    # model.name -> name_or_path
    cased = [n for n in sorted(names) if n.lower() == leaf.lower()]                 # TRAIN -> train, LR -> lr
    near = cased or near or starts[:len(starts) == 1] or difflib.get_close_matches(leaf, sorted(names), n=1, cutoff=0.5)
    return ".".join([*map(str, parts[:-1]), near[0]]) if near else None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                base: dict | None = None) -> Config:
    """Read YAML, apply `key=value` overrides, validate. Raises UserError with a one-line message (the only line:
    a warning about a key it read is said once the config is accepted, never before its refusal)."""
    outer = getattr(_HELD, "lines", None)
    _HELD.lines = held = []
    try:
        cfg = _load_config(path, overrides, base)
    finally:
        _HELD.lines = outer
    for line in held:
        warn(line)
    return cfg


CONFIG_BYTES = 16 << 20


def _load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...], base: dict | None) -> Config:
    tree: dict = dict(base or {})
    if isinstance(tree.get("train"), dict):
        tree["train"] = _migrate_train(tree["train"])
    if path is not None:
        p = Path(path)
        if not str(path).strip():
            raise UserError("config: empty; expected the path of a YAML config file (such as configs/tiny.yaml)")
        if p.is_dir():
            raise UserError(f"config: {path} is a folder; expected a YAML config file (such as configs/tiny.yaml)")
        if not p.exists():
            raise UserError(f"config: file not found: {path}")
        if not p.is_file():
            raise UserError(f"config: {path} is not a regular file (a device, a pipe); expected a YAML config file")
        if (size := p.stat().st_size) > CONFIG_BYTES:         # (read whole and parsed: a minute for 60 MB)
            raise UserError(f"config: {path}: {size:,} bytes, past a config's {CONFIG_BYTES:,}; expected a YAML "
                            f"config file (data goes in a file data.path names)")
        try:
            loaded = load_yaml(p.read_text(encoding="utf-8"), f"config: {path}")
        except UnicodeDecodeError as e:
            raise UserError(f"config: {path}: not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise UserError(f"config: {path}: cannot read it ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise UserError(f"config: {path}{problem(e)}") from None
        if loaded is None and not overrides and not base:
            raise UserError(f"config: {path}: holds no settings; expected sections such as model:, data: and "
                            f"reward: (see configs/tiny.yaml)")
        loaded = {} if loaded is None else loaded
        if not isinstance(loaded, dict):
            raise UserError(f"config: {path}: expected a mapping of sections at the top level, got "
                            f"{type(loaded).__name__}")
        _resolve_relative(loaded, p.parent)
        if isinstance(loaded.get("train"), dict):
            loaded["train"] = _migrate_train(loaded["train"])   # before the overrides, which may name the new keys
        tree.update(loaded)
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r}: expected key=value (e.g. train.lr=1e-6)")
        key, raw = item.split("=", 1)
        if not all(map(str.isidentifier, parts := key.split("."))):           # ("=5": no key, parts [""])
            if at := next((i for i, p in enumerate(parts) if i and p.isascii() and p.isdigit()), 0):  # functions.0
                one = {at + 1: raw, at + 2: f"{{..., {parts[-1]}: {raw}}}"}.get(len(parts), "...")   # in its place
                raise UserError(f"override {item!r}: a list item cannot be set by index; set the whole list, e.g. -o "
                                + shlex.quote(f"{'.'.join(parts[:at])}=[{'..., ' * (int(parts[at]) > 0)}{one}]"))
            raise UserError(f"override {item!r}: expected a dotted key such as train.lr")
        key = key.strip()
        section, _, rest = key.partition(".")
        if section == "train" and rest.split(".")[0] in LEARNER_KEYS:     # train.gamma=0.9: train.learner.gamma
            moved(key, f"train.learner.{rest}")
            key = f"train.learner.{rest}"
        value = _parse_value(key, raw)
        if isinstance(value, int | float) and _text_field(key.split(".")):
            value = raw                 # (`-o run.name=08` is the text 08, not the number 8 refused as one)
        _set_dotted(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise UserError(_format_error(err)) from None


def reference_markdown() -> str:
    """docs/configuration.md, generated from the models above (tests/test_config_docs.py keeps it in sync)."""
    lines = ["# Configuration reference", "",
             "Generated from `tasks/core/config.py` by `python -m tasks.core.config > docs/configuration.md`.",
             "A config file sets only what differs from these defaults; `-o section.key=value` overrides on the "
             "command line. Unknown keys are errors (a setting of another learner than train.algorithm's: a "
             "warning, so one config can switch algorithms).", ""]
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}

    def table(prefix: str, model, tag: str = "") -> None:
        nested = []
        doc = " ".join(inspect.cleandoc(model.__doc__).split())
        title, _, rest = doc.partition(". ")         # the first sentence heads the table; the rest, a paragraph
        lines.extend([f"## `{prefix}`{tag} — {title.rstrip('.')}", "", *([rest, ""] if rest else []),
                      "| key | type | default | meaning |", "|---|---|---|---|"])
        for name, f in model.model_fields.items():
            if f.exclude:                    # a learner's tag: train.algorithm fills it in
                continue
            sections = [a for a in (f.annotation, *get_args(f.annotation)) if isinstance(a, type)
                        and issubclass(a, Section)]
            if sections == [LearnerConfig]:  # train.learner: a table per built-in learner's settings
                tags = list(BUILT_IN_LEARNERS)
                sections = [LEARNER_CONFIGS[t] for t in tags]
                nested += [(f"{prefix}.{name}", s, f" (algorithm: {t})") for s, t in zip(sections, tags)]
                lines.append(f"| `{prefix}.{name}` | section, one of {', '.join(tags)} | | {f.description or ''} "
                             f"(see `{prefix}.{name}` below) |")
                continue
            if sections:
                section = sections[0]
                nested.append((f"{prefix}.{name}", section, ""))      # its own table below
                kind = "section" if section is f.annotation else "section, optional (default: none)"
                lines.append(f"| `{prefix}.{name}` | {kind} | | {f.description or ''} (see `{prefix}.{name}`) |")
                continue
            typ = str(f.annotation)
            for noise in ("typing.", "__main__.", "tasks.core.config.", "<class '", "'>"):
                typ = typ.replace(noise, "")
            typ = typ.replace("|", "\\|")
            default = ("required" if f.is_required() else "(see meaning)" if f.default_factory is not None
                       else f"`{json.dumps(f.default, default=str)}`")
            bounds = ", ".join(f"{symbols[k]} {getattr(m, k)}" for m in f.metadata for k in symbols if hasattr(m, k))
            lines.append(f"| `{prefix}.{f.alias or name}` | {typ} | {default} | {f.description or ''}"
                         f"{f' ({bounds})' if bounds else ''} |")
        lines.append("")
        for sub_prefix, sub, sub_tag in nested:
            table(sub_prefix, sub, sub_tag)

    for section, field in Config.model_fields.items():
        model = next(a for a in (field.annotation, *get_args(field.annotation)) if isinstance(a, type))
        table(section, model, "" if model is field.annotation else " (optional: none by default)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())
