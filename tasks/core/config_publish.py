"""The config sections of what becomes of a trained policy: `publish` (how it is made visible: whole or as a
delta, its dtype, MLflow model versions) and `eval` (scoring published policies on held-out prompts, and the
metric that picks the best one).

Assembled into the whole config, and re-exported, by tasks/core/config.py.
More: docs/internals.md (tasks/core/config_publish.py): the checks these sections make.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from tasks.core.config_base import HOW_NOT_WHAT, SINCE_DEFAULT, Section
from tasks.core.config_generate import MIN_TEMPERATURE
from tasks.core.config_inputs import dataset_name


class PublishConfig(Section):
    """Making a trained policy visible."""

    register_model: bool = Field(True, description="Register published policies as MLflow model versions "
                                 "(which ones: publish.register).")
    register_versions: Literal["evaluated", "every"] = Field(
        "evaluated", alias="register", json_schema_extra=HOW_NOT_WHAT,
        description="Which published policies become model versions: evaluated "
        "(those eval.every scores, and the run's last) or every (each iteration's: 200 versions for 200 "
        "iterations).")
    delta: Literal["auto", "always", "never"] = Field(
        "auto", description="Publish policies as sparse deltas against the last whole one when that is smaller "
                            "(bf16 policies at RL learning rates). auto: on an S3 store, where a generator on "
                            "another machine downloads each policy; on a file store a whole policy is linked from "
                            "its checkpoint at no cost, so a delta would only spend CPU. LoRA adapters are always "
                            "whole.")
    anchor_every: int = Field(10, ge=1, le=1_000_000, description="With deltas, every N-th policy is published "
                              "whole (an anchor) and the ones between as deltas against it. 1 = every policy "
                              "whole.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the published weights (what the generators load). auto: bfloat16 when a "
                            "full model trains in float32 on a GPU, and always with the deepspeed engine; else "
                            "model.dtype. The trainer keeps its own weights exactly (a full checkpoint stores them "
                            "beside the published ones when the dtypes differ).")
    registered_model_name: str | None = Field(None, min_length=1,
                                              description="MLflow registered model name; None = run.name.")


class EvalConfig(Section):
    """Scoring published policies on held-out prompts, and keeping the best one (policy/BEST)."""

    every: int = Field(0, ge=0, le=1_000_000,
                       description="Evaluate every N iterations (and after the last); 0 = never.")
    path: str | None = Field(None, description="Held-out data file or hub id; None = data.path.")
    name: str | None = Field(None, description="Hub dataset configuration name; None = data.name.")
    split: str = Field("test", description="Held-out split.")
    max_prompts: int = Field(64, ge=1, le=1_000_000, description="Evaluate on the first N rows of the split.")
    num_generations: int = Field(4, ge=0, le=65_536, description="Samples per prompt (n of pass@k); 0 with greedy: the "
                                 "greedy pass alone (eval/greedy_*; half the time of an episode environment's "
                                 "evaluation when only the deployed policy's success matters).")
    k: int = Field(1, ge=1, le=65_536, description="k of pass@k (unbiased estimator over num_generations samples).")
    pass_threshold: float = Field(1.0, ge=-1e6, le=1e6,
                                  description="A completion passes when its combined reward (or pass_reward's "
                                  "score) is at least this.")
    pass_reward: str | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="The reward function (its name, e.g. answer_reward) whose "
        "score decides a pass: accuracy apart from format or shaping rewards; None = the combined reward.")
    format_reward: str | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="The reward function (its name, e.g. format_reward) "
        "whose score 1 means the answer came in the asked form: eval/greedy_format_share and "
        "eval/greedy_pass_at_1_formatted (accuracy among those) beside the accuracy, so that a gain in form "
        "cannot pass for learning (weight 0 logs a function without paying for it).")
    temperature: float | None = Field(None, ge=MIN_TEMPERATURE, le=100, description="Sampling temperature (at least "
                                      "0.001); None = generate.temperature.")
    greedy: bool = Field(False, json_schema_extra=SINCE_DEFAULT,
                         description="Also one greedy completion per prompt (the most likely token each step): "
                         "eval/greedy_pass_at_1, the accuracy a deployed policy shows.")
    baseline: bool = Field(False, json_schema_extra=SINCE_DEFAULT,
                           description="Also evaluate the starting model before iteration 1 (eval/v000000, logged at "
                           "step 0); then BEST and the champion move only to a policy that beats it.")
    screenshots: int = Field(8, ge=0, le=10_000, json_schema_extra=SINCE_DEFAULT,
                             description="Pictures of the first N evaluated episodes (the greedy ones with "
                             "eval.greedy) where the environment can take them (a factory with a `screenshots` "
                             "keyword, the browser's, made by the stage): the page before each action, with the "
                             "action, in <run>/eval/vN/screens, MLflow's artifacts (screens/vN) and the Prefect "
                             "report (a strip per episode). 0: none.")
    metric: Literal["reward_mean", "pass_at_k", "greedy_pass_at_1"] = Field(
        "reward_mean", description="What BEST and the MLflow `champion` alias maximise (greedy_pass_at_1 needs "
        "greedy).")

    def metric_key(self) -> str:
        """The logged metric BEST and champion compare ('@' is not allowed in MLflow metric names)."""
        return {"reward_mean": "eval/reward_mean", "greedy_pass_at_1": "eval/greedy_pass_at_1"}.get(
            self.metric, f"eval/pass_at_{self.k}")

    _a_name = field_validator("path", "name", "split")(dataset_name)

    @model_validator(mode="after")
    def _k_le_n(self):
        if self.num_generations == 0:
            if not self.greedy or self.metric != "greedy_pass_at_1":
                raise ValueError("num_generations: 0 (no sampled pass) needs greedy: true and metric: "
                                 "greedy_pass_at_1")
        elif self.k > self.num_generations:
            raise ValueError(f"k ({self.k}) must be <= num_generations ({self.num_generations})")
        if self.metric == "greedy_pass_at_1" and not self.greedy:
            raise ValueError("metric: greedy_pass_at_1 needs greedy: true")
        return self
